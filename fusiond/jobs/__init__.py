"""fusiond.jobs: the job lifecycle around the stage executor.

- `submit`: what the submitter runs (validate, build, capture; refusals named).
- `planning`: plan a job on the cluster's profile (OP-Fence, AdaTopK) -> `JobLayout`; the
  cluster view -> planner `Cluster` adapter (`cluster_for_planner`).
- `service`: the daemon's `JobService` (lifecycle, message dispatch, the attempts of the jobs
  it schedules, persistence, the API's methods).
- `submission`: the submitter role, `Submissions` (forward a job to the scheduler, follow its
  updates and outputs, fail it over when the scheduler dies or gives it back).
- `runner`: the scheduler's restart decision (`decide_restart`), a pure function.
- `records`: what the service keeps of each job; `views`: what the API shows of them.
- `assign`: lay a graph out on machines and build each machine's `Assign`.
- `coordinator`: the scheduler side of a running job (start, follow, fail first, cancel,
  re-adapt densities, checkpoints, gather the result); `worker`: the daemon side (host stages).
- `results`: gather weights into one state dict, write model and metrics.
- Running jobs without daemons (several nodes in one process, bare node processes) is
  harness work: `fusiond.harness`.
"""
