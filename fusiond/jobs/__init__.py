"""fusiond.jobs: the job lifecycle around the stage executor.

- `submit`: what the submitter runs (validate, build, capture; refusals named).
- `planning`: plan a job on the cluster's profile (OP-Fence, AdaTopK) -> `JobLayout`; the
  cluster view -> planner `Cluster` adapter (`cluster_for_planner`).
- `service`: the daemon's `JobService` (lifecycle, message dispatch by type, persistence and
  retention, the API's methods).
- `scheduling`: the scheduler role, `Scheduling` (take a job to run here: plan it, run its
  attempts, restart and re-adapt them; send its updates and outputs back to its submitter, or
  store them here; hand it back when this daemon loses the lease).
- `submission`: the submitter role, `Submissions` (forward a job to the scheduler, follow its
  updates and outputs, fail it over when the scheduler dies or gives it back).
- `runner`: the scheduler's decisions (`decide_restart`, `released_exclusions`,
  `derived_timeouts`), pure functions.
- `records`: what the service keeps of each job; `views`: what the API shows of them.
- `assign`: lay a graph out on machines and build each machine's `Assign`.
- `coordinator`: the scheduler side of a running job (start, follow, fail first, cancel,
  re-adapt densities, checkpoints, gather the result); `worker`: the daemon side (host stages).
- `results`: gather weights into one state dict, write model and metrics.
- Running jobs without daemons (several nodes in one process, bare node processes) is
  harness work: `fusiond.harness`.
"""
