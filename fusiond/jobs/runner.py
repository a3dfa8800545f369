"""The scheduler role's decisions about a running job, as pure functions of plain values.

`decide_restart` is the one place that says whether a failed attempt is restarted (and whom
the next attempt leaves out), `released_exclusions` when a machine left out is planned
again, and `derived_timeouts` how long an attempt waits for Ready and its stages for their
inputs, from the measured links. `Scheduling` (fusiond/jobs/scheduling.py) asks them, then acts:
it re-plans, builds the next `JobCoordinator`, hands the job back. They take no service, no
network and no clock: tests/train/test_restart_decision.py calls them with plain values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from fusiond.jobs.assign import JobLayout
from fusiond.jobs.coordinator import (
    FAULT_JOB,
    FAULT_MACHINE,
    FAULT_REFUSED,
    FAULT_SCHEDULER,
    FAULT_STALE,
    FailureReport,
)
from fusiond.plan import Cluster, Plan
from fusiond.train.remote import MAX_RECV_TIMEOUT_S, MIN_RECV_TIMEOUT_S
from fusiond.train.stage import is_input_timeout

__all__ = [
    "EXCLUDE_FOR_S",
    "RECV_TIMEOUT_ITERATIONS",
    "SHIP_TIMEOUT_FACTOR",
    "RestartDecision",
    "decide_restart",
    "derived_timeouts",
    "released_exclusions",
]

EXCLUDE_FOR_S = 60.0
"""How long a job's later attempts are planned without a machine that failed it (unless it
restarts sooner: then it is planned again at once). Long enough that a machine the failure
detector has not yet declared dead is not picked again at once; bounded so that a job outlives
more machine failures than it has machines."""
RECV_TIMEOUT_ITERATIONS = 10.0
"""A stage waits for its inputs at least this many of the plan's predicted iterations (on the
measured links), so an 8 Mbit/s link carrying big activations never trips the stage's own
`recv_timeout_s`, which stays the floor."""
SHIP_TIMEOUT_FACTOR = 3.0
"""The scheduler waits for Ready at least this many times the time the largest partition's
weights take over the measured link to its machine (plus the configured `ready_timeout_s`)."""


@dataclass(frozen=True)
class RestartDecision:
    """What to do after an attempt ended. `why` names the branch taken (for tests and logs):
    "ok", "no_failure", "cancelled", "closed", "not_leading", "handed_back", "stale",
    "job_fault", "scheduler_fault", "no_machines", "scheduler_machine", "max_restarts",
    "restart" (a machine failed or refused: left out) or "victim" (the scheduler's own stage
    only waited too long for an input: restarted, blaming none)."""

    restart: bool
    why: str
    log: str | None = None
    """The line for the job's log (None: nothing to say)."""
    hand_back: str | None = None
    """Why the job goes back to the next scheduler (set `handed_back` to it); None: it does
    not (or already did)."""
    exclude: tuple[str, ...] = ()
    """The machines the next attempt is planned without (a restart only)."""
    refused: bool = False
    """Whether `exclude` refused their partition (left out until they restart, not only for
    `EXCLUDE_FOR_S`)."""


def decide_restart(ok: bool, failure: FailureReport | None, *, self_node: str, restarts: int,
                   max_restarts: int, cancel_requested: bool = False, closed: bool = False,
                   handed_back: str = "", not_leading: str | None = None) -> RestartDecision:
    """Whether the attempt that ended (`ok`, `failure`) is restarted on this scheduler
    (`self_node`), after `restarts` restarts of at most `max_restarts`. `handed_back`: why the
    job was already given up (empty: it was not); `not_leading`: why this daemon may not
    schedule now (None: it holds the scheduler's lease)."""
    if ok:
        return RestartDecision(False, "ok")
    if failure is None:
        return RestartDecision(False, "no_failure")
    if cancel_requested:
        return RestartDecision(False, "cancelled")
    if closed:
        return RestartDecision(False, "closed")
    attempt = restarts + 1
    if not handed_back and not_leading is not None:
        # a minority never re-plans: the next scheduler does
        return RestartDecision(
            False, "not_leading", hand_back=not_leading,
            log=f"attempt {attempt} failed ({failure}); not restarted here: {not_leading}")
    if handed_back:
        return RestartDecision(False, "handed_back")
    if failure.fault == FAULT_STALE:
        # This daemon's view lags (it was frozen or cut off while another scheduler was
        # elected): the job goes to that one. It used to end the job failed (the chaos
        # check: a scheduler thawed after 3 s restarted its job in its stale term).
        return RestartDecision(
            False, "stale",
            hand_back=f"a member does not take this daemon for the scheduler: {failure}",
            log=f"attempt {attempt} failed ({failure}); not restarted here: "
                "another scheduler was elected")
    if failure.fault == FAULT_JOB:  # the same on every machine: blame none, retry never
        return RestartDecision(False, "job_fault", log=f"not restarted: {failure}")
    # A machine that refused its partition is left out, the scheduler's own included; any
    # other failure of the scheduler's machine (or side) ends the job, except its stage
    # waiting too long for an input: this machine is alive, a neighbour or the link to it
    # failed (a tensor lost when a dial failed), and the attempt restarts, blaming none
    # (the chaos check saw such a timeout on the scheduler's own stage, reported before
    # the neighbours' own timeouts could arrive, end a job for good).
    victim = failure.node == self_node and failure.fault == FAULT_MACHINE \
        and is_input_timeout(failure.cause)
    if failure.fault == FAULT_SCHEDULER:
        return RestartDecision(False, "scheduler_fault")
    if not failure.machines:
        return RestartDecision(False, "no_machines")
    if failure.fault != FAULT_REFUSED and failure.node == self_node and not victim:
        return RestartDecision(False, "scheduler_machine")
    if restarts >= max_restarts:
        return RestartDecision(False, "max_restarts")
    return RestartDecision(
        True, "victim" if victim else "restart", log=f"attempt {attempt} failed: {failure}",
        exclude=tuple(m for m in failure.machines if not (victim and m == self_node)),
        refused=failure.fault == FAULT_REFUSED)


def released_exclusions(excluded: Mapping[str, tuple[int | None, float, bool]],
                        incarnation: Callable[[str], int | None], now: float
                        ) -> dict[str, str]:
    """The machines of `excluded` (machine -> (its incarnation when it failed the job, when
    (monotonic clock), whether it refused its partition)) that are planned again at `now`,
    each with why, in `excluded`'s order. A machine that failed the job is planned again once
    it restarted (`incarnation(machine)` differs) or, unless it refused its partition,
    `EXCLUDE_FOR_S` after its failure: exclusions used to last the job's life, so after every
    other machine had failed once (a chaos run's kills, freezes and partitions of a minority)
    the job ran on ever fewer stages, and the next failure ended it."""
    released: dict[str, str] = {}
    for node, (inc, at, refused) in excluded.items():
        cur = incarnation(node)
        if (cur is not None and inc is not None and cur != inc) \
                or (not refused and now - at >= EXCLUDE_FOR_S):
            released[node] = ("it restarted since it failed" if cur != inc else
                              f"{EXCLUDE_FOR_S:g}s since it failed")
    return released


def derived_timeouts(layout: JobLayout, state: Mapping[str, torch.Tensor], plan: Plan | None,
                     cluster: Cluster, scheduler: str, ready_floor_s: float
                     ) -> tuple[float, float | None]:
    """(ready timeout, stages' receive timeout) for a job, from the measured links: Ready may
    take the configured `ready_floor_s` plus `SHIP_TIMEOUT_FACTOR` x the slowest partition's
    weights over its link from the scheduler; a stage waits `RECV_TIMEOUT_ITERATIONS` x the
    plan's predicted iteration (None without a plan: the stages' own bound)."""
    ids = cluster.ids()
    ship = 0.0
    for s in layout.stages:
        nbytes = sum(state[k].numel() * state[k].element_size()
                     for k in s.partition.param_names if k in state)
        if s.node_id != scheduler and scheduler in ids and s.node_id in ids:
            link_bytes_per_s = float(
                cluster.bandwidth_bytes_per_s[ids.index(scheduler), ids.index(s.node_id)])
            ship = max(ship, nbytes / link_bytes_per_s)
    recv = None
    if plan is not None:  # within what an Assign may carry (a fast plan asks for little)
        recv = min(MAX_RECV_TIMEOUT_S,
                   max(MIN_RECV_TIMEOUT_S, RECV_TIMEOUT_ITERATIONS * plan.iteration_s))
    return ready_floor_s + SHIP_TIMEOUT_FACTOR * ship, recv
