"""The chaos run's checker: what must hold after any mix of crash-stop faults, freezes and
partitions of a minority (tests/chaos/runner.py applies them; docs/chaos.md).

Each check is a pure function of what the run left behind (the daemons' logs, the job's
metrics.json and model, the processes' exit codes) and returns a `Verdict`: ok, and the
violations, each a sentence naming what was seen and where. They are unit-tested on
synthetic inputs (tests/chaos/test_checker.py), so a checker that cannot fail is caught too.

1. `one_scheduler_per_term`: across every node's log (all its runs), each term has at most one
   scheduler. Every node logs `cluster: scheduler is X, term N` whenever it starts to follow
   X in term N, or leads it (`(this node)`): two nodes leading one term, or two followers
   following different leaders in one term, both show.
2. `steps_exactly_once`: the job's metrics.json (the submitter's full step history) holds every
   step from 0 to steps-1 exactly once, in order, each with a finite loss.
3. `model_is_sane`: the job ended done, its model.safetensors loads strictly into the job's
   model, every weight is finite, and its loss on fixed held-out batches is below the loss of
   the initial weights on the same batches.
4. `exits_expected`: every daemon exit was one the nemesis caused (SIGKILL: -9; SIGTERM: 0
   within the stop timeout), and `no_leftovers`: no process of the run outlived it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LEADER_LINE", "ProcessExit", "Verdict", "exits_expected", "leaders_by_term",
           "model_is_sane", "no_leftovers", "one_scheduler_per_term", "steps_exactly_once"]

LEADER_LINE = re.compile(
    r"^(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ fusiond\.cluster\.service: "
    r"cluster: scheduler is (?P<leader>\S+), term (?P<term>\d+)(?P<own> \(this node\))?")
"""A leadership line of a daemon's log (`Cluster._log_leadership`)."""


@dataclass
class Verdict:
    """One check's outcome: `ok`, what was checked (`detail`), and each violation."""

    name: str
    ok: bool
    detail: str
    violations: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail,
                "violations": list(self.violations)}


def _verdict(name: str, detail: str, violations: list[str]) -> Verdict:
    return Verdict(name, not violations, detail, violations)


# -- 1. at most one scheduler per term ---------------------------------------------------------


@dataclass(frozen=True)
class LeaderClaim:
    """One leadership line: who (`node`, the log's owner) saw whom lead which term."""

    node: str
    term: int
    leader: str
    stamp: str
    line: str


def leaders_by_term(logs: Mapping[str, str]) -> dict[int, list[LeaderClaim]]:
    """term -> every claim of its scheduler in `logs` (node name -> log text)."""
    out: dict[int, list[LeaderClaim]] = {}
    for node, text in logs.items():
        for line in text.splitlines():
            m = LEADER_LINE.match(line)
            if m is None:
                continue
            term, leader = int(m.group("term")), m.group("leader")
            out.setdefault(term, []).append(LeaderClaim(node, term, leader, m.group("stamp"),
                                                        line))
    return out


def one_scheduler_per_term(logs: Mapping[str, str]) -> Verdict:
    """At most one scheduler per term across all the nodes' logs."""
    terms = leaders_by_term(logs)
    violations = []
    for term, claims in sorted(terms.items()):
        leaders = sorted({c.leader for c in claims})
        if len(leaders) > 1:
            seen = "; ".join(f"{c.node} at {c.stamp}: {c.leader}"
                             for c in sorted(claims, key=lambda c: c.stamp))
            violations.append(f"term {term} had {len(leaders)} schedulers ({', '.join(leaders)})"
                              f": {seen}")
    claims_n = sum(len(c) for c in terms.values())
    detail = (f"{len(terms)} terms with a scheduler ({min(terms, default=0)}.."
              f"{max(terms, default=0)}), {claims_n} leadership lines in {len(logs)} logs")
    if not terms:
        violations.append("no leadership line in any log: the check saw nothing")
    return _verdict("one scheduler per term", detail, violations)


# -- 2. every step exactly once ----------------------------------------------------------------


def steps_exactly_once(metrics: Mapping[str, Any], steps: int) -> Verdict:
    """metrics.json's `steps` holds 0..steps-1 exactly once, in order, each loss finite."""
    records = metrics.get("steps")
    violations: list[str] = []
    if not isinstance(records, list):
        return _verdict("every step exactly once", "no steps list",
                        ["metrics.json has no `steps` list"])
    got = [r.get("step") if isinstance(r, Mapping) else None for r in records]
    counts: dict[Any, int] = {}
    for s in got:
        counts[s] = counts.get(s, 0) + 1
    dup = sorted(s for s, n in counts.items() if n > 1 and isinstance(s, int))
    missing = sorted(set(range(steps)) - set(counts))
    extra = sorted(s for s in counts if not (isinstance(s, int) and 0 <= s < steps))
    if dup:
        violations.append(f"{len(dup)} step(s) recorded more than once: {_ranges(dup)}")
    if missing:
        violations.append(f"{len(missing)} step(s) missing: {_ranges(missing)}")
    if extra:
        violations.append(f"record(s) of steps outside 0..{steps - 1}: {extra[:10]}")
    if not dup and not missing and not extra and got != list(range(steps)):
        violations.append("the steps are not in order")
    bad = [r.get("step") for r in records if isinstance(r, Mapping)
           and not (isinstance(r.get("loss"), int | float) and math.isfinite(r["loss"]))]
    if bad:
        violations.append(f"{len(bad)} step(s) without a finite loss: {bad[:10]}")
    summary = metrics.get("summary") or {}
    if summary.get("thinned_steps"):
        violations.append(f"the history was thinned ({summary['thinned_steps']} dropped)")
    return _verdict("every step exactly once", f"{len(records)} records for {steps} steps",
                    violations)


def _ranges(values: Sequence[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7' (at most 10 ranges)."""
    out: list[str] = []
    start = prev = None
    for v in [*values, None]:
        if v is not None and prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    return ", ".join(out[:10]) + (f", ... ({len(out)} ranges)" if len(out) > 10 else "")


# -- 3. a valid model --------------------------------------------------------------------------


def model_is_sane(job_toml: Path, output: Path, state: str, *, batches: int = 4,
                  max_ratio: float = 0.9) -> Verdict:
    """The job ended `done`; `output/model.safetensors` loads strictly into the job's model,
    every tensor is finite, and its mean loss on `batches` fixed held-out batches (steps the
    job never trained on) is at most `max_ratio` x the initial weights' loss on them."""
    import torch

    from fusiond.jobs.results import load_model_state
    from fusiond.train.data import make_source
    from fusiond.train.model import build_model, loss_fn
    from fusiond.train.spec import load_job

    violations: list[str] = []
    if state != "done":
        violations.append(f"the job ended {state}, not done")
    path = output / "model.safetensors"
    if not path.exists():
        return _verdict("a valid model", f"no {path}", [*violations, f"{path} does not exist"])
    spec = load_job(job_toml)
    try:
        weights = load_model_state(path)
    except Exception as e:  # a torn or foreign file: the violation names it
        return _verdict("a valid model", str(path), [*violations, f"{path} does not load: {e}"])
    bad = [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        violations.append(f"non-finite weights in {len(bad)} tensor(s): {bad[:5]}")
    initial = build_model(spec.model, seed=spec.seed)
    trained = build_model(spec.model, seed=spec.seed)
    try:
        trained.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        return _verdict("a valid model", str(path),
                        [*violations, f"the model does not load strictly: {e}"])
    source = make_source(spec.data, spec.seed + 1_000_003)  # windows the job never drew
    fn = loss_fn(spec.loss)

    def mean_loss(model: torch.nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            total = 0.0
            for i in range(batches):
                b = source.batch(i, spec.batch.size)
                total += float(fn(model(b.inputs), b.targets))
        return total / batches

    before, after = mean_loss(initial), mean_loss(trained)
    if not math.isfinite(after):
        violations.append(f"held-out loss is {after}")
    elif after > max_ratio * before:
        violations.append(f"held-out loss {after:.4f} is not below {max_ratio:g} x the initial "
                          f"weights' {before:.4f}")
    return _verdict("a valid model", f"held-out loss {before:.4f} -> {after:.4f} on {batches} "
                    f"batches of {spec.batch.size}", violations)


# -- 4. exits and leftovers --------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessExit:
    """One daemon process of the run: how it ended and what the nemesis expected."""

    node: str
    pid: int
    returncode: int | None
    """None: still running when checked."""
    expected: str
    """'kill' (SIGKILL: -9), 'term' (SIGTERM: 0), or '' (it was not asked to stop)."""
    stop_s: float | None = None
    """For 'term': seconds from SIGTERM to exit."""


def exits_expected(exits: Iterable[ProcessExit], stop_timeout_s: float) -> Verdict:
    """Every exit is one the nemesis caused: SIGKILL -> -9; SIGTERM -> 0 within
    `stop_timeout_s` (+ 2 s); no process ended unasked, or is still running."""
    violations = []
    n = 0
    for e in exits:
        n += 1
        who = f"{e.node} (pid {e.pid})"
        if e.returncode is None:
            violations.append(f"{who} is still running")
        elif e.expected == "kill":
            if e.returncode != -9:
                violations.append(f"{who} exited {e.returncode} before its SIGKILL took effect")
        elif e.expected == "term":
            if e.returncode != 0:
                violations.append(f"{who} exited {e.returncode} after SIGTERM (a clean stop "
                                  "is 0)")
            elif e.stop_s is not None and e.stop_s > stop_timeout_s + 2.0:
                violations.append(f"{who} took {e.stop_s:.1f}s to stop after SIGTERM "
                                  f"(stop_timeout_s = {stop_timeout_s:g})")
        else:
            violations.append(f"{who} exited {e.returncode} on its own (a crash)")
    return _verdict("no daemon crashed on its own", f"{n} daemon processes", violations)


def no_leftovers(marker: str, proc_root: Path = Path("/proc")) -> Verdict:
    """No process whose command line names `marker` (the run's directory) is left."""
    left = []
    me = {os.getpid(), os.getppid()}
    for d in proc_root.iterdir():
        if not d.name.isdigit() or int(d.name) in me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            left.append(f"pid {d.name}: {cmd.strip()[:160]}")
    return _verdict("no leftover processes", f"processes naming {marker}", left)


def load_metrics(path: Path) -> dict[str, Any]:
    """metrics.json as a dict (an empty one with a `steps` of None when unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"steps": None}
    return data if isinstance(data, dict) else {"steps": None}
