"""Pipeline schedules: the per-stage order of forward and backward tasks in one iteration.

Stages are numbered 0..S-1 in a topological order of the partition DAG (stage 0 reads the data;
edges only go from a lower to a higher stage). A stage runs its tasks strictly in the order
given here; a task starts once its inputs have arrived. Both schedules are deadlock-free for any
DAG of stages whose edges go forward in that numbering (`simulate` checks it).

- GPipe: all M forwards, then all M backwards. Holds M micro-batches' activations.
- 1F1B: stage i runs min(S-1-i, M) warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards: at most S-i micro-batches in flight at stage i.
  A plan may give a stage more in flight (`in_flight[i]`, up to M: GPipe's M is the limit):
  where a micro-batch's round trip from stage i to the last stage and back (compute, transfers,
  latency) is longer than S-i of stage i's tasks, the default leaves stage i waiting on the
  link; more warm-up forwards keep it busy (the planner weighs this against their memory,
  `fusiond.plan.pipeline.evaluate`). Any in-flight counts that do not grow down the pipeline
  (in_flight[i] >= in_flight[j] for every edge i -> j) keep the schedule deadlock-free: a
  stage waiting on B(m) has sent every forward its successors need before their B(m).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fusiond.errors import LocalError

__all__ = [
    "Phase",
    "ScheduleError",
    "Task",
    "default_in_flight",
    "gpipe",
    "max_in_flight",
    "one_f_one_b",
    "replica_slots",
    "replica_tasks",
    "schedule",
    "simulate",
]


class ScheduleError(LocalError):
    """A schedule is invalid: a task repeats or is missing, or the pipeline would deadlock."""


class Phase(enum.StrEnum):
    """Forward or backward."""

    F = "F"
    B = "B"


@dataclass(frozen=True, order=True)
class Task:
    """One task of one stage: the forward or backward of micro-batch `micro`."""

    phase: Phase
    micro: int

    def __str__(self) -> str:
        return f"{self.phase}{self.micro}"


def _check(stages: int, micro: int) -> None:
    if stages < 1:
        raise ScheduleError(f"need at least one stage, got {stages}")
    if micro < 1:
        raise ScheduleError(f"need at least one micro-batch, got {micro}")


def gpipe(stages: int, micro: int) -> list[list[Task]]:
    """GPipe: per stage, F0..F(M-1) then B0..B(M-1)."""
    _check(stages, micro)
    one = [Task(Phase.F, m) for m in range(micro)] + [Task(Phase.B, m) for m in range(micro)]
    return [list(one) for _ in range(stages)]


def default_in_flight(stages: int, stage: int, micro: int) -> int:
    """1F1B's micro-batches in flight on `stage` of `stages`: min(S - i, M)."""
    return min(stages - stage, micro)


def one_f_one_b(stages: int, micro: int, in_flight: Mapping[int, int] | None = None
                ) -> list[list[Task]]:
    """1F1B (PipeDream-Flush): warm-up forwards, steady one-forward-one-backward, drain;
    stage i keeps `in_flight[i]` micro-batches in flight where given (capped at M), else
    min(S - i, M)."""
    _check(stages, micro)
    out: list[list[Task]] = []
    for i in range(stages):
        want = (in_flight or {}).get(i)
        if want is not None and want < 1:
            raise ScheduleError(f"stage {i}: {want} micro-batches in flight; at least 1")
        warm = min((want if want is not None else stages - i) - 1, micro)
        tasks = [Task(Phase.F, m) for m in range(warm)]
        nf, nb = warm, 0
        while nf < micro:
            tasks.append(Task(Phase.F, nf))
            nf += 1
            tasks.append(Task(Phase.B, nb))
            nb += 1
        tasks.extend(Task(Phase.B, m) for m in range(nb, micro))
        out.append(tasks)
    return out


def schedule(kind: str, stages: int, micro: int, in_flight: Mapping[int, int] | None = None
             ) -> list[list[Task]]:
    """The schedule named `kind` ("1f1b" or "gpipe"); `in_flight`: 1F1B's per-stage counts
    (`one_f_one_b`; GPipe has all M in flight anyway)."""
    if kind == "1f1b":
        return one_f_one_b(stages, micro, in_flight)
    if kind == "gpipe":
        return gpipe(stages, micro)
    raise ScheduleError(f"unknown pipeline schedule {kind!r}; known: ['1f1b', 'gpipe']")


def max_in_flight(tasks: Sequence[Task]) -> int:
    """The most micro-batches whose forward has run but whose backward has not, at any point."""
    live = peak = 0
    for t in tasks:
        live += 1 if t.phase is Phase.F else -1
        peak = max(peak, live)
    return peak


def simulate(
    tasks: Sequence[Sequence[Task]], upstream: Mapping[int, Sequence[int]] | None = None
) -> list[tuple[int, Task]]:
    """Run a schedule in lock-step and return one valid global order of (stage, task).

    `upstream[i]` lists the stages that send to stage i (default: the chain, i-1 -> i). F(i, m)
    needs F(j, m) for each upstream j; B(i, m) needs F(i, m) and B(k, m) for each downstream k.
    Raises `ScheduleError` if a stage's list is not exactly one F and one B per micro-batch with
    F before B, or if the stages would wait on each other forever.
    """
    n = len(tasks)
    ups: dict[int, list[int]] = {
        i: list(upstream.get(i, ())) if upstream is not None else ([i - 1] if i else [])
        for i in range(n)
    }
    downs: dict[int, list[int]] = {i: [] for i in range(n)}
    for i, us in ups.items():
        for j in us:
            if not 0 <= j < n or j >= i:
                raise ScheduleError(f"stage {i}: upstream stage {j} must be in [0, {i})")
            downs[j].append(i)
    for i, ts in enumerate(tasks):
        seen_f: set[int] = set()
        seen_b: set[int] = set()
        for t in ts:
            bucket = seen_f if t.phase is Phase.F else seen_b
            if t.micro in bucket:
                raise ScheduleError(f"stage {i}: task {t} appears twice")
            if t.phase is Phase.B and t.micro not in seen_f:
                raise ScheduleError(f"stage {i}: task {t} comes before its forward")
            bucket.add(t.micro)
        if seen_f != seen_b:
            raise ScheduleError(
                f"stage {i}: forwards {sorted(seen_f)} != backwards {sorted(seen_b)}"
            )
    done: set[tuple[int, Phase, int]] = set()
    pos = [0] * n
    order: list[tuple[int, Task]] = []
    progressed = True
    while progressed:
        progressed = False
        for i in range(n):
            if pos[i] >= len(tasks[i]):
                continue
            t = tasks[i][pos[i]]
            if t.phase is Phase.F:
                ok = all((j, Phase.F, t.micro) in done for j in ups[i])
            else:
                ok = all((k, Phase.B, t.micro) in done for k in downs[i])
            if ok:
                done.add((i, t.phase, t.micro))
                order.append((i, t))
                pos[i] += 1
                progressed = True
    stuck = [i for i in range(n) if pos[i] < len(tasks[i])]
    if stuck:
        waits = ", ".join(f"stage {i} at {tasks[i][pos[i]]}" for i in stuck)
        raise ScheduleError(f"pipeline deadlocks: {waits}")
    return order


def replica_tasks(kind: str, stage: int, stages: int, micros: Sequence[int],
                  in_flight: int | None = None) -> list[Task]:
    """A replica's tasks: the schedule of `stage` over its own micro-batches (`micros`, in
    the iteration's numbering), so each replica fills and drains as a stage of the pipeline
    would with that many micro-batches (`in_flight` of them at most where given)."""
    if not micros:
        return []
    base = schedule(kind, stages, len(micros),
                    None if in_flight is None else {stage: in_flight})[stage]
    return [Task(t.phase, micros[t.micro]) for t in base]


def replica_slots(replicas: Sequence[int]) -> dict[tuple[int, int], int]:
    """(stage, replica) -> slot, for stages with `replicas[stage]` replicas each: replica 0
    of stage s is slot s (a stage without replicas is addressed as before), the others
    numbered on from the number of stages."""
    out: dict[tuple[int, int], int] = {}
    nxt = len(replicas)
    for s, n in enumerate(replicas):
        for r in range(n):
            if r == 0:
                out[(s, r)] = s
            else:
                out[(s, r)] = nxt
                nxt += 1
    return out
