"""Pure parts of `bench/wan.py`: the job every system trains, the runners' trace format, and the
figures, ratios, targets and table computed from the traces (no torch, no I/O beyond JSON).

A runner writes one JSON trace: ``{"system": ..., "events": [[t_s, step, loss, tokens], ...],
"extra": {...}}`` where `t_s` is seconds since the runner's t0 (just before it ships the model:
the coordinator's Assign, DDP's parameter broadcast, hivemind's Optimizer), `step` the global
optimizer step that just finished, `loss` that step's loss (None where unknown), `tokens` the
tokens of the global batches finished so far.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POWERSGD_START_STEPS = 2
"""Dense steps before low-rank gradients, for DDP's PowerSGD hook (`start_powerSGD_iter`)
and fusion's replicas (`compression.grad_warmup_steps`, 10 by default) alike: the same
compressor gets the same warm-up (at 10 dense steps of a few seconds each over a 50 Mbit/s
link, a 30 s run never left it)."""

SYSTEMS = ("single", "pipeline", "ddp_fp16", "ddp_powersgd", "fsdp", "hivemind", "swarm",
           "opfence", "adatopk", "replicas", "codecs")
"""Every system of issue 14: the baselines (0), (1), (4) twice, FSDP, (5), (6), then fusion
(and issue 21's OP-Fence with replicas)."""

LABELS = {
    "single": "(0) fastest host alone",
    "pipeline": "(1) torch pipelining, equal blocks",
    "ddp_fp16": "(4) DDP + fp16 hook",
    "ddp_powersgd": "(4) DDP + PowerSGD",
    "fsdp": "(4) FSDP",
    "hivemind": "(5) hivemind 1.1.12",
    "swarm": "(6) SWARM-style int8 cuts",
    "opfence": "(2) fusion OP-Fence, dense",
    "adatopk": "(3) fusion OP-Fence + AdaTopK",
    "replicas": "(7) fusion OP-Fence with replicas",
    "codecs": "(8) fusion OP-Fence + per-link codecs",
}


@dataclass(frozen=True)
class Workload:
    """What every system trains: the same model, data, global batch and optimizer.

    `n_layer`/`n_embd`/`n_head` override the named GPT-2 size (0: the size's own);
    `corpus` is the training split's file (empty: the default corpus, all of it)."""

    size: str = "mini"
    vocab_size: int = 256
    seq_len: int = 64
    batch: int = 16
    micro_batches: int = 4
    lr: float = 1e-3
    seed: int = 0
    n_layer: int = 0
    n_embd: int = 0
    n_head: int = 0
    corpus: str = ""

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    def model_overrides(self) -> dict[str, int]:
        """`fusiond.models.gpt2.gpt2(size, **overrides)`'s overrides."""
        out = {"vocab_size": self.vocab_size}
        for k in ("n_layer", "n_embd", "n_head"):
            v = int(getattr(self, k))
            if v:
                out[k] = v
        return out

    def job_toml(self, *, adatopk: bool, steps: int = 1_000_000,
                 checkpoint_interval: int = 0, codec: str = "topk",
                 replicas: bool = False) -> str:
        """The fusion job file: constant learning rate (a wall-clock budget has no 'last step'
        for a schedule to decay to), AdamW, byte tokens of the training split (or of the
        default corpus; no held-out split of its own: the bench holds out its own); `codec` is
        the job's `compression.codec` ("int8": SWARM-style int8
        cut edges, then `adatopk` must be False)."""
        config = ", ".join([f'size = "{self.size}"']
                           + [f"{k} = {v}" for k, v in self.model_overrides().items()])
        path = f"\npath = {json.dumps(self.corpus)}" if self.corpus else ""
        return f"""
[job]
name = "bench-wan"
steps = {steps}
seed = {self.seed}
checkpoint_interval = {checkpoint_interval}
[model]
zoo = "gpt2"
config = {{ {config} }}
[data]
seq_len = {self.seq_len}{path}
heldout = 0.0
[optimizer]
kind = "adamw"
lr = {self.lr}
[batch]
size = {self.batch}
micro_batches = {self.micro_batches}
replicas = {"true" if replicas else "false"}
[compression]
codec = "{codec}"
adatopk = {"true" if adatopk else "false"}
grad_warmup_steps = {POWERSGD_START_STEPS}
"""

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "vocab_size": self.vocab_size, "seq_len": self.seq_len,
                "batch": self.batch, "micro_batches": self.micro_batches, "lr": self.lr,
                "seed": self.seed, "n_layer": self.n_layer, "n_embd": self.n_embd,
                "n_head": self.n_head, "corpus": self.corpus}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Workload:
        return cls(size=str(d["size"]), vocab_size=int(d["vocab_size"]),
                   seq_len=int(d["seq_len"]), batch=int(d["batch"]),
                   micro_batches=int(d["micro_batches"]), lr=float(d["lr"]),
                   seed=int(d["seed"]), n_layer=int(d.get("n_layer", 0)),
                   n_embd=int(d.get("n_embd", 0)), n_head=int(d.get("n_head", 0)),
                   corpus=str(d.get("corpus", "")))


def window_offsets(n_tokens: int, seq_len: int, seed: int, step: int, size: int) -> Any:
    """Start offsets of `step`'s windows: the same function as `fusiond.train.data.TextWindows`
    (numpy `default_rng([seed, step])`), so a runner without fusiond draws the same samples."""
    import numpy as np

    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=size)


# -- traces --------------------------------------------------------------------------------


@dataclass
class Trace:
    """One run's events (see the module docstring) and whatever else the runner reported."""

    system: str
    events: list[tuple[float, int, float | None, int]]
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps({"system": self.system, "events": self.events, "extra": self.extra,
                           "error": self.error})

    @classmethod
    def load(cls, path: Path) -> Trace:
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Trace:
        """A trace from its JSON form (`to_json`, or a run's "trace" in a traces file)."""
        ev = [(float(t), int(s), None if loss is None else float(loss), int(tok))
              for t, s, loss, tok in d["events"]]
        return cls(str(d["system"]), ev, dict(d.get("extra") or {}), d.get("error"))


@dataclass(frozen=True)
class Figures:
    """What the table shows for one run."""

    system: str
    steps: int
    tokens_per_s: float | None
    time_to_target_s: float | None
    final_loss: float | None
    wire_bytes: int | None
    wire_bytes_per_token: float | None
    predicted_tokens_per_s: float | None = None
    error: str | None = None


def smoothed(losses: Sequence[float], window: int) -> list[float]:
    """Trailing mean over `window` values (fewer at the start): one step's loss is noisy."""
    out: list[float] = []
    acc = 0.0
    for i, x in enumerate(losses):
        acc += x
        if i >= window:
            acc -= losses[i - window]
        out.append(acc / min(i + 1, window))
    return out


def throughput(events: Sequence[tuple[float, int, float | None, int]], skip: int) -> float | None:
    """Tokens/s between the end of event `skip - 1` (warm-up: the model shipping, first steps)
    and the last event; None when fewer than `skip + 1` events."""
    if len(events) <= skip or skip < 1:
        return None
    t0, _, _, tok0 = events[skip - 1]
    t1, _, _, tok1 = events[-1]
    if t1 <= t0:
        return None
    return (tok1 - tok0) / (t1 - t0)


def time_to_target(events: Sequence[tuple[float, int, float | None, int]], target: float,
                   window: int) -> float | None:
    """Seconds until the smoothed loss first reaches `target` (None: never within the budget)."""
    known = [(t, loss) for t, _, loss, _ in events if loss is not None]
    sm = smoothed([loss for _, loss in known], window)
    for (t, _), v in zip(known, sm, strict=True):
        if v <= target:
            return t
    return None


def final_loss(events: Sequence[tuple[float, int, float | None, int]], window: int
               ) -> float | None:
    """The smoothed loss at the end of the budget."""
    losses = [loss for _, _, loss, _ in events if loss is not None]
    return smoothed(losses, window)[-1] if losses else None


def figures(trace: Trace, *, target: float, window: int, skip: int,
            wire_bytes: int | None) -> Figures:
    """A run's row. `wire_bytes`: what the hosts' interfaces sent during the run."""
    ev = trace.events
    tokens = ev[-1][3] if ev else 0
    pred = trace.extra.get("predicted_tokens_per_s")
    return Figures(
        system=trace.system,
        steps=ev[-1][1] + 1 if ev else 0,
        tokens_per_s=throughput(ev, skip),
        time_to_target_s=time_to_target(ev, target, window),
        final_loss=final_loss(ev, window),
        wire_bytes=wire_bytes,
        wire_bytes_per_token=(wire_bytes / tokens) if wire_bytes is not None and tokens else None,
        predicted_tokens_per_s=float(pred) if pred is not None else None,
        error=trace.error,
    )


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is unknown or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


# -- held-out evaluation (issue 14) ---------------------------------------------------------


@dataclass(frozen=True)
class HeldoutPoint:
    """The held-out loss of a run's dense weights saved `t_s` seconds into it, after `step`."""

    t_s: float
    step: int
    loss: float


def loss_at(curve: Sequence[HeldoutPoint], t_s: float) -> float | None:
    """The held-out loss a run had at wall-clock `t_s`: that of its latest snapshot taken at
    or before `t_s` (None before its first)."""
    best: HeldoutPoint | None = None
    for p in curve:
        if p.t_s <= t_s and (best is None or p.t_s >= best.t_s):
            best = p
    return None if best is None else best.loss


def at_fixed_points(curve: Sequence[HeldoutPoint], interval_s: float, budget_s: float
                    ) -> list[tuple[float, float | None]]:
    """(t, held-out loss at t) at t = interval, 2 x interval, ... up to the budget: the same
    wall-clock points for every system."""
    n = math.floor(budget_s / interval_s + 1e-9)
    return [(k * interval_s, loss_at(curve, k * interval_s)) for k in range(1, n + 1)]


def time_to_heldout_target(curve: Sequence[HeldoutPoint], target: float) -> float | None:
    """Seconds until the held-out loss reaches `target` (None: never): the first snapshot at
    or below it, interpolated linearly in time from the snapshot before it (above the
    target), so the figure is not rounded up to the snapshot interval."""
    prev: HeldoutPoint | None = None
    for p in sorted(curve, key=lambda q: q.t_s):
        if not math.isfinite(p.loss):
            prev = None
            continue
        if p.loss <= target:
            if prev is None or prev.loss <= p.loss:
                return p.t_s
            return prev.t_s + (prev.loss - target) / (prev.loss - p.loss) * (p.t_s - prev.t_s)
        prev = p
    return None


# -- outcomes and the verdict (issue 14) ------------------------------------------------------

OK = "ok"
OUT_OF_MEMORY = "out of memory"
"""The kernel killed a host of the run at its memory limit (`deploy.testbed.classify_exit`)."""
OUT_OF_REGIME = "out of regime"
"""The system cannot train in this setting at all (the reason says why); never a fusion win."""
FAILED = "failed"
"""The harness or the system broke: a failed run fails the bench."""
OUTCOMES = (OK, OUT_OF_MEMORY, OUT_OF_REGIME, FAILED)


@dataclass(frozen=True)
class RunResult:
    """One run of one system on one topology in one regime, as the verdict sees it."""

    system: str
    outcome: str
    time_to_target_s: float | None = None
    """None with outcome ok: the target held-out loss was not reached within the budget."""
    final_loss: float | None = None
    """Held-out loss at the end of the budget."""
    reason: str = ""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome {self.outcome!r}: one of {OUTCOMES}")


@dataclass(frozen=True)
class Spread:
    """Median and min-max over runs (inf: a run that never reached the target)."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, xs: Sequence[float]) -> Spread:
        return cls(statistics.median(xs), min(xs), max(xs), len(xs))

    def text(self, unit: str = " s", digits: int = 1) -> str:
        def f(x: float) -> str:
            return "not reached" if math.isinf(x) else f"{x:.{digits}f}{unit}"
        if self.n == 1:
            return f"{f(self.median)} (1 run)"
        return f"{f(self.median)} [{f(self.lo)} .. {f(self.hi)}] ({self.n} runs)"


@dataclass(frozen=True)
class SystemSummary:
    """What all runs of one system say: its outcome (ok only when every run trained), the
    spread of its time to target and of its final held-out loss over the ok runs."""

    system: str
    outcome: str
    time_to_target: Spread | None
    final_loss: Spread | None
    reason: str = ""

    @property
    def score(self) -> tuple[float, float]:
        """Lower is better: median time to target (inf: not reached), then final loss."""
        if self.outcome != OK or self.time_to_target is None:
            return (math.inf, math.inf)
        fl = self.final_loss.median if self.final_loss is not None else math.inf
        return (self.time_to_target.median, fl if math.isfinite(fl) else math.inf)


def summarize(system: str, runs: Sequence[RunResult]) -> SystemSummary:
    """The summary of `runs` (all of `system`): failed if any run failed, else out of memory /
    out of regime if any run ended so, else ok with medians and min-max."""
    if not runs:
        return SystemSummary(system, FAILED, None, None, "missing: no run")
    for outcome in (FAILED, OUT_OF_MEMORY, OUT_OF_REGIME):
        bad = [r for r in runs if r.outcome == outcome]
        if bad:
            return SystemSummary(system, outcome, None, None,
                                 f"{len(bad)} of {len(runs)} runs: {bad[0].reason}".rstrip(": "))
    tt = Spread.of([math.inf if r.time_to_target_s is None else r.time_to_target_s
                    for r in runs])
    finals = [r.final_loss for r in runs if r.final_loss is not None]
    return SystemSummary(system, OK, tt, Spread.of(finals) if finals else None)


@dataclass(frozen=True)
class TopologyVerdict:
    """One topology and regime: fusion's best system against the strongest baseline."""

    topology: str
    regime: str
    fusion: SystemSummary | None
    baseline: SystemSummary | None
    summaries: Mapping[str, SystemSummary]
    problems: tuple[str, ...]
    """Missing or failed systems: each fails the bench."""

    @property
    def ok(self) -> bool:
        """The bench itself held (every system ran); says nothing about who won."""
        return not self.problems

    @property
    def fusion_wins(self) -> bool | None:
        """True / False; None when there is nothing to compare (a side with no ok run, or no
        baseline but out-of-regime ones: an out-of-regime baseline is never a fusion win)."""
        f, b = self.fusion, self.baseline
        if f is None or f.outcome != OK:
            return None if b is None else False
        if b is None:
            # no baseline trained: a win only when every one ran out of memory (fusion
            # trained where none could); out of regime never counts as a fusion win
            others = [s for n, s in self.summaries.items() if n not in FUSION_SYSTEMS]
            return True if others and all(s.outcome == OUT_OF_MEMORY for s in others) else None
        return f.score < b.score

    def line(self, labels: Mapping[str, str]) -> str:
        def side(s: SystemSummary | None, what: str) -> str:
            if s is None:
                return f"no {what} trained"
            if s.outcome != OK:
                return f"{labels.get(s.system, s.system)}: {s.outcome} ({s.reason})"
            assert s.time_to_target is not None
            fl = f", final held-out loss {s.final_loss.text('', 3)}" if s.final_loss else ""
            return (f"{labels.get(s.system, s.system)}: time to target "
                    f"{s.time_to_target.text()}{fl}")
        win = {True: "fusion wins", False: "fusion loses", None: "no comparison"}[
            self.fusion_wins]
        head = "FAIL" if self.problems else "ok  "
        text = (f"{head} {self.topology} [{self.regime}] fusion best {side(self.fusion, 'fusion')}"
                f" / strongest baseline {side(self.baseline, 'baseline')}: {win}")
        untrained = [f"{labels.get(n, n)} {s.outcome} ({s.reason})"
                     for n, s in self.summaries.items()
                     if s.outcome in (OUT_OF_MEMORY, OUT_OF_REGIME)
                     and s is not self.fusion]
        if untrained:
            text += " | did not train: " + "; ".join(untrained)
        if self.problems:
            text += " -- " + "; ".join(self.problems)
        return text


FUSION_SYSTEMS = frozenset({"opfence", "adatopk", "replicas", "codecs"})
"""Fusion as its planner decides, (2) and (3); every other system is a baseline."""


def verdict(topology: str, regime: str, runs: Iterable[RunResult],
            expected: Sequence[str]) -> TopologyVerdict:
    """The verdict of one topology and regime over every run of every system in `expected`.

    A system of `expected` with no run, or with a failed run, is a problem (the bench fails);
    out of memory and out of regime are outcomes, not problems. The strongest baseline is
    the baseline with the best score among those whose runs all trained (out-of-regime ones
    never count); fusion's best the best of (2) and (3)."""
    by: dict[str, list[RunResult]] = {s: [] for s in expected}
    for r in runs:
        by.setdefault(r.system, []).append(r)
    summaries = {s: summarize(s, rs) for s, rs in by.items()}
    problems = tuple(f"{s}: {summaries[s].reason}" for s in by
                     if summaries[s].outcome == FAILED)
    fusion = [summaries[s] for s in by if s in FUSION_SYSTEMS]
    base = [summaries[s] for s in by if s not in FUSION_SYSTEMS and summaries[s].outcome == OK]
    best_f = min(fusion, key=lambda s: s.score) if fusion else None
    best_b = min(base, key=lambda s: s.score) if base else None
    if not any(s not in FUSION_SYSTEMS for s in by):
        problems += ("no baseline expected: a bench without one proves nothing",)
    if not fusion:
        problems += ("no fusion run expected",)
    return TopologyVerdict(topology, regime, best_f, best_b, summaries, problems)
