"""One evaluator for every system of `bench/wan.py` (issue 14): the held-out loss of the DENSE
weights, on a held-out split of the data, at fixed wall-clock points.

- The data: the default corpus's tokens (Python's standard library, bytes) cut into chunks of
  `CHUNK_TOKENS`, the chunks shuffled by the workload's seed; the first chunks up to
  `train_tokens` are the training split (every system trains on it: fusion gets it as its job's
  corpus file, DDP reads the same file, hivemind the same tokens), the next ones up to
  `heldout_tokens` the held-out split, which no system ever sees. Both come from the same
  modules (no shift between them), and no window of one overlaps the other.
- The weights: every runner saves the whole model's state (`save_snapshot`) each time its
  wall clock passes the next multiple of the snapshot interval (`SnapshotClock`) and once at
  the end: DDP rank 0's replica, fusion's gathered stage states (`JobCoordinator`'s
  checkpoints: the stages' own parameters, never the top-k-masked tensors that cross a link),
  hivemind peer 0's averaged parameters. A snapshot is safetensors with its wall-clock time
  and step in the metadata.
- The evaluation runs after the run, outside the budget and outside the hosts' quotas, with
  the same code for every system (`evaluate_snapshots`): the model built from the job spec,
  `load_state_dict(strict=True)`, eval mode, the mean loss over fixed windows of the held-out
  split (`heldout_batch`). `bench.wan_common` turns the curve into the loss at fixed wall-clock
  points and the time to a target held-out loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bench.wan_common import HeldoutPoint

CHUNK_TOKENS = 4096
"""Granularity of the train/held-out split: long enough that a window (65 tokens) rarely
straddles two chunks of different files' text, short enough to mix every module into both."""
SNAPSHOT_PREFIX = "snap-"


def split_tokens(tokens: np.ndarray, *, seed: int, train_tokens: int, heldout_tokens: int,
                 chunk_tokens: int = CHUNK_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out): disjoint sets of whole chunks of `tokens`, shuffled by `seed`.

    ValueError when the corpus has fewer chunks than both splits need."""
    n_chunks = tokens.size // chunk_tokens
    n_train = math.ceil(train_tokens / chunk_tokens)
    n_held = math.ceil(heldout_tokens / chunk_tokens)
    if n_train < 1 or n_held < 1 or n_train + n_held > n_chunks:
        raise ValueError(f"a corpus of {tokens.size} tokens ({n_chunks} chunks of "
                         f"{chunk_tokens}) cannot give {train_tokens} training and "
                         f"{heldout_tokens} held-out tokens")
    order = np.random.default_rng([seed, 14]).permutation(n_chunks)
    chunks = tokens[:n_chunks * chunk_tokens].reshape(n_chunks, chunk_tokens)
    train = chunks[np.sort(order[:n_train])].reshape(-1)
    held = chunks[np.sort(order[n_train:n_train + n_held])].reshape(-1)
    return np.ascontiguousarray(train), np.ascontiguousarray(held)


@dataclass(frozen=True)
class HeldoutBatch:
    """Fixed evaluation windows: inputs and targets (shifted by one), (count, seq_len)."""

    inputs: torch.Tensor
    targets: torch.Tensor


def heldout_batch(tokens: np.ndarray, *, seq_len: int, count: int) -> HeldoutBatch:
    """`count` non-overlapping windows of `seq_len + 1` tokens, evenly spaced over `tokens`
    (the same windows every time: a deterministic function of the split)."""
    span = seq_len + 1
    if count < 1 or tokens.size < count * span:
        raise ValueError(f"{tokens.size} held-out tokens cannot give {count} windows of {span}")
    stride = tokens.size // count
    starts = np.arange(count) * stride
    win = torch.from_numpy(np.asarray(tokens, dtype=np.int64)[starts[:, None]
                                                             + np.arange(span)[None, :]])
    return HeldoutBatch(win[:, :-1].contiguous(), win[:, 1:].contiguous())


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def heldout_loss(model: nn.Module, batch: HeldoutBatch, lossf: LossFn,
                 eval_batch: int = 32) -> float:
    """Mean loss of `model` (eval mode, no gradients) over every window of `batch`, each window
    weighted equally; the model's training mode is restored."""
    was_training = model.training
    model.eval()
    total = 0.0
    n = batch.inputs.shape[0]
    try:
        with torch.no_grad():
            for lo in range(0, n, eval_batch):
                x, y = batch.inputs[lo:lo + eval_batch], batch.targets[lo:lo + eval_batch]
                total += float(lossf(model(x), y)) * x.shape[0]
    finally:
        model.train(was_training)
    return total / n


class SnapshotClock:
    """When a runner saves a snapshot: the first time its clock passes each multiple of
    `interval_s` (a step that passes several saves one)."""

    def __init__(self, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"snapshot interval {interval_s} s must be positive")
        self.interval_s = interval_s
        self._next_s = interval_s

    def due(self, t_s: float) -> bool:
        if t_s < self._next_s:
            return False
        self._next_s = (math.floor(t_s / self.interval_s) + 1) * self.interval_s
        return True


def save_snapshot(directory: Path, index: int, t_s: float, step: int,
                  state: dict[str, torch.Tensor]) -> Path:
    """The whole model's dense state after `step` (`t_s` seconds into the run), as safetensors
    (never pickle) with the time and step in its metadata."""
    import safetensors.torch

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{SNAPSHOT_PREFIX}{index:05d}.safetensors"
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    tmp = path.with_suffix(".tmp")
    safetensors.torch.save_file(tensors, str(tmp),
                                metadata={"t_s": repr(float(t_s)), "step": str(int(step))})
    tmp.replace(path)
    return path


def load_snapshot(path: Path) -> tuple[float, int, dict[str, torch.Tensor]]:
    """(t_s, step, state) of one snapshot; ValueError naming the file when it is malformed."""
    import safetensors
    import safetensors.torch

    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        t_s, step = float(meta["t_s"]), int(meta["step"])
        state = safetensors.torch.load_file(str(path))
    except (OSError, KeyError, ValueError, safetensors.SafetensorError) as exc:
        raise ValueError(f"snapshot {path} is unreadable: {exc}") from exc
    if not (math.isfinite(t_s) and t_s >= 0 and step >= 0):
        raise ValueError(f"snapshot {path}: bad time {t_s} or step {step}")
    return t_s, step, state


def evaluate_snapshots(directory: Path, make_model: Callable[[], nn.Module],
                       batch: HeldoutBatch, lossf: LossFn) -> list[HeldoutPoint]:
    """The held-out curve of one run: every snapshot under `directory` loaded (strictly) into
    a fresh model and evaluated, in time order."""
    out = []
    for path in sorted(directory.glob(f"{SNAPSHOT_PREFIX}*.safetensors")):
        t_s, step, state = load_snapshot(path)
        model = make_model()
        model.load_state_dict(state, strict=True)
        out.append(HeldoutPoint(t_s, step, heldout_loss(model, batch, lossf)))
    return sorted(out, key=lambda p: p.t_s)
