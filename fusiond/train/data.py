"""Data sources: byte-level (or tokenizers) text windows and synthetic images.

Determinism contract: the batch of step `s` depends only on (the corpus, `seed`, `s`), never on
which process asks or in which order, so a single-process run and every stage of a distributed
run draw identical batches. A batch is a pair `(inputs, targets)` of torch tensors whose first
dimension is the batch size; `split_micro_batches` cuts it into equal consecutive slices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from fusiond.errors import LocalError
from fusiond.train.spec import DataSpec

__all__ = [
    "Batch",
    "DataError",
    "DataSource",
    "SyntheticImages",
    "TextWindows",
    "corpus_digest",
    "make_source",
    "split_micro_batches",
    "text_files",
    "text_tokens",
]

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
DEFAULT_MAX_BYTES = 64 << 20
"""Corpus bytes read (the first files in sorted order up to this size)."""
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


class DataError(LocalError):
    """The data source is missing, empty or unreadable; the message names the path."""


@dataclass(frozen=True)
class Batch:
    """One batch (or micro-batch): `inputs` and `targets` share the leading batch dimension."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def size(self) -> int:
        """Number of samples."""
        return int(self.inputs.shape[0])


class DataSource(Protocol):
    """Anything that yields the deterministic batch of a step."""

    def batch(self, step: int, size: int) -> Batch:
        """The batch of `step` (0-based) with `size` samples."""
        ...


def split_micro_batches(batch: Batch, count: int) -> list[Batch]:
    """Cut a batch into `count` equal consecutive micro-batches (size must divide evenly)."""
    if count < 1 or batch.size % count:
        raise LocalError(f"batch of {batch.size} does not split into {count} micro-batches")
    n = batch.size // count
    return [
        Batch(batch.inputs[i * n : (i + 1) * n], batch.targets[i * n : (i + 1) * n])
        for i in range(count)
    ]


def text_files(root: Path) -> list[Path]:
    """The text files of a corpus: `root` itself, or every text file under it, sorted.

    Installed third-party packages (site-packages) are skipped so that the default corpus is the
    standard library's own sources, identical on every machine with the same Python.
    """
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"data path does not exist: {root}")
    out: list[Path] = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).parts
        if any(part in _SKIP_DIRS for part in rel[:-1]):
            continue
        if p.suffix in TEXT_SUFFIXES and p.is_file():
            out.append(p)
    return out


@functools.lru_cache(maxsize=4)
def _load_tokens(root: str, tokenizer: str, max_bytes: int) -> np.ndarray:
    """Tokenize the corpus once per process (cached): a flat int64 token array."""
    files = text_files(Path(root))
    chunks: list[bytes] = []
    total = 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {f}: {e.strerror}") from e
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    raw = b"".join(chunks)[:max_bytes]
    if tokenizer == "bytes":
        tokens = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    else:
        try:
            from tokenizers import Tokenizer
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise DataError("data.tokenizer needs the 'tokenizers' package") from e
        tok = Tokenizer.from_file(tokenizer)
        ids = tok.encode(raw.decode("utf-8", errors="replace")).ids
        tokens = np.asarray(ids, dtype=np.int64)
    return tokens


def corpus_digest(tokens: np.ndarray) -> str:
    """Content hash of a token array (xxh3-128 of its int64 little-endian bytes): equal on two
    machines iff they would train on the same tokens."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(tokens, dtype="<i8").tobytes())


def text_tokens(spec: DataSpec) -> np.ndarray:
    """The token array of a text data spec (what a submitter ships to machines lacking it)."""
    assert spec.kind == "text" and spec.path is not None
    return _load_tokens(str(spec.path), spec.tokenizer, DEFAULT_MAX_BYTES)


class TextWindows:
    """Random windows of `seq_len + 1` tokens from a corpus; targets are inputs shifted by one.

    The offsets of step `s` come from `numpy.random.default_rng([seed, s])`: a pure function of
    the seed and the step.
    """

    def __init__(self, path: Path | None, *, seq_len: int, seed: int, tokenizer: str = "bytes",
                 max_bytes: int = DEFAULT_MAX_BYTES, tokens: np.ndarray | None = None) -> None:
        if tokens is None:
            if path is None:
                raise DataError("a text source needs a path or its tokens")
            tokens = _load_tokens(str(path), tokenizer, max_bytes)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.seq_len = seq_len
        self.seed = seed
        if self.tokens.ndim != 1 or self.tokens.size < seq_len + 2:
            raise DataError(
                f"corpus {path or '(shipped)'} has {self.tokens.size} tokens, needs more than "
                f"seq_len+1={seq_len + 1}"
            )
        self.vocab_size = int(self.tokens.max()) + 1

    def batch(self, step: int, size: int) -> Batch:
        """The deterministic batch of `step`."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=size)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        win = torch.from_numpy(self.tokens[idx])
        return Batch(inputs=win[:, :-1].contiguous(), targets=win[:, 1:].contiguous())


class SyntheticImages:
    """Learnable synthetic images: a fixed random template per class plus per-sample noise.

    Templates come from `seed` alone; the samples of step `s` from `default_rng([seed, s])`.
    """

    def __init__(self, *, image_size: int, channels: int, num_classes: int, seed: int,
                 noise: float = 0.5) -> None:
        self.shape = (channels, image_size, image_size)
        self.num_classes = num_classes
        self.seed = seed
        self.noise = noise
        rng = np.random.default_rng([seed, 2**32 - 1])
        self.templates = rng.standard_normal((num_classes, *self.shape)).astype(np.float32)

    def batch(self, step: int, size: int) -> Batch:
        """The deterministic batch of `step`: float32 images (N, C, H, W), int64 labels."""
        rng = np.random.default_rng([self.seed, step])
        labels = rng.integers(0, self.num_classes, size=size)
        noise = rng.standard_normal((size, *self.shape)).astype(np.float32)
        images = self.templates[labels] + np.float32(self.noise) * noise
        return Batch(torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64)))


def make_source(spec: DataSpec, seed: int) -> TextWindows | SyntheticImages:
    """Build the data source a job spec names."""
    if spec.kind == "text":
        assert spec.path is not None
        return TextWindows(spec.path, seq_len=spec.seq_len, seed=seed, tokenizer=spec.tokenizer)
    return SyntheticImages(
        image_size=spec.image_size, channels=spec.channels, num_classes=spec.num_classes, seed=seed
    )
