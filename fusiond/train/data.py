"""Data sources: batches of named tensors, drawn deterministically per step.

A batch is a mapping of named tensors sharing the leading batch dimension (`input_ids`,
`attention_mask`, `token_type_ids`, `labels`, `decoder_input_ids`, `pixel_values`, ...);
`Batch.inputs` is its main input and `Batch.targets` its labels. Where the tensors come from:

- `TextWindows`: a token stream (a text corpus, or every record of a JSON-lines / Parquet /
  `datasets` source joined by the tokenizer's end-of-text token), cut into random windows of
  `seq_len + 1` tokens: next-token labels, or masked-LM masking over the window;
- `TextRows`: one example per record, truncated and padded to `seq_len` with its attention
  mask; the labels are made here by the objective (next token with `ignore_index` at the pads,
  masked positions, the target text with its decoder inputs shifted right, a class, a value);
- `ImageArrays`: decoded images (uint8) and their classes, normalised and augmented per step;
- `SyntheticImages`: learnable synthetic images (a template per class plus noise).

Determinism contract: the batch of step `s` depends only on (the data, `seed`, `s`), never on
which process asks or in which order, so a single-process run and every stage of a distributed
run draw identical batches (masking and augmentation included: they use the same
`numpy.random.default_rng([seed, s])`). Every source holds out a split it never trains on
(`heldout_batches`, the same batches whatever the seed). The arrays a source is built from are
what the submitter ships to the stages that read data (`source_from_arrays`); readers of files
on disk are in `fusiond.train.readers` and run only on the submitting machine.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from fusiond.errors import LocalError
from fusiond.train.spec import DataSpec, default_text_path

__all__ = [
    "DATA_PREFIX",
    "HELDOUT_SEED",
    "MAX_DATA_BYTES",
    "Batch",
    "DataError",
    "DataSource",
    "ImageArrays",
    "SyntheticImages",
    "TextRows",
    "TextWindows",
    "TokenMeta",
    "check_arrays",
    "compact_arrays",
    "corpus_digest",
    "dataset_digest",
    "is_default_corpus",
    "load_arrays",
    "make_source",
    "source_from_arrays",
    "split_indices",
    "split_micro_batches",
    "text_files",
    "text_tokens",
]

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
DEFAULT_MAX_BYTES = 64 << 20
"""Corpus bytes read (the first files in sorted order up to this size)."""
MAX_DATA_BYTES = 512 << 20
"""The most bytes of arrays a job's data may ship to its stages (tokens, rows, images)."""
DATA_PREFIX = "__fusion_data__."
"""Prefix of the shipped data's entries in an Assign's safetensors payload."""
HELDOUT_SEED = 0x48454C44
"""Seeds the held-out split and its masking: the same whatever the job's seed."""
MAX_HELDOUT_EXAMPLES = 4096
"""At most this many held-out examples (or windows) are evaluated."""
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}
_ARRAY_NAMES = {"tokens", "input_ids", "lengths", "type_ids", "labels", "target_ids",
                "target_lengths", "pixel_values", "token_meta", "special_ids"}
_ARRAY_DTYPES = {np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.int64),
                 np.dtype(np.float32)}


class DataError(LocalError):
    """The data source is missing, empty, malformed or too large; the message names the path
    (and the record or file) and what to do."""


class Batch:
    """One batch (or micro-batch): named tensors sharing the leading batch dimension.

    `primary` names the main input (`input_ids`, `pixel_values`; what a model that takes one
    tensor gets), `target` the labels. `batch["inputs"]` and `batch["targets"]` are those two
    (the names a stage's data inputs use); any other key is a field. `Batch(x, y)` is the older
    two-tensor form.
    """

    __slots__ = ("fields", "primary", "target")

    def __init__(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                 *, fields: Mapping[str, torch.Tensor] | None = None,
                 primary: str = "inputs", target: str = "targets") -> None:
        if fields is None:
            if inputs is None or targets is None:
                raise LocalError("a Batch needs inputs and targets, or fields")
            fields = {primary: inputs, target: targets}
        if primary not in fields or target not in fields:
            raise LocalError(f"a Batch's fields {sorted(fields)} lack {primary!r} or {target!r}")
        self.fields: dict[str, torch.Tensor] = dict(fields)
        self.primary = primary
        self.target = target

    @property
    def inputs(self) -> torch.Tensor:
        """The main input."""
        return self.fields[self.primary]

    @property
    def targets(self) -> torch.Tensor:
        """The labels."""
        return self.fields[self.target]

    @property
    def size(self) -> int:
        """Number of samples."""
        return int(self.inputs.shape[0])

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == "inputs":
            return self.inputs
        if key == "targets":
            return self.targets
        return self.fields[key]

    def __contains__(self, key: object) -> bool:
        return key in ("inputs", "targets") or key in self.fields

    def slice(self, lo: int, hi: int) -> Batch:
        """Samples `lo .. hi-1` of every field."""
        return Batch(fields={k: v[lo:hi] for k, v in self.fields.items()},
                     primary=self.primary, target=self.target)

    def clone(self) -> Batch:
        """A copy whose tensors own their memory."""
        return Batch(fields={k: v.clone() for k, v in self.fields.items()},
                     primary=self.primary, target=self.target)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self.fields.items())
        return f"Batch({shapes})"


class DataSource(Protocol):
    """Anything that yields the deterministic batch of a step."""

    def batch(self, step: int, size: int) -> Batch:
        """The batch of `step` (0-based) with `size` samples."""
        ...


def split_micro_batches(batch: Batch, count: int, sizes: Sequence[int] = ()) -> list[Batch]:
    """Cut a batch into `count` consecutive micro-batches: equal ones (the size must divide
    evenly), or of `sizes` samples each (`count` of them, adding up to the batch)."""
    if sizes:
        if len(sizes) != count or sum(sizes) != batch.size or min(sizes) < 1:
            raise LocalError(f"micro-batch sizes {list(sizes)[:8]} do not cut a batch of "
                             f"{batch.size} into {count} micro-batches")
        bounds = [0, *itertools.accumulate(sizes)]
        return [batch.slice(lo, hi) for lo, hi in itertools.pairwise(bounds)]
    if count < 1 or batch.size % count:
        raise LocalError(f"batch of {batch.size} does not split into {count} micro-batches")
    n = batch.size // count
    return [batch.slice(i * n, (i + 1) * n) for i in range(count)]


def split_indices(n: int, heldout: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) example indices of a source of `n` examples: a fixed permutation
    (`HELDOUT_SEED`, not the job's seed), its first `round(heldout * n)` (at least 1 when
    `heldout` > 0) held out; both sorted."""
    if heldout <= 0.0 or n < 2:
        return np.arange(n), np.arange(0)
    held = min(n - 1, max(1, round(heldout * n)))
    perm = np.random.default_rng(HELDOUT_SEED).permutation(n)
    return np.sort(perm[held:]), np.sort(perm[:held])


# -- tokens ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenMeta:
    """What the data path needs to know of a tokenizer: its vocabulary size and the ids of its
    padding, mask and end-of-text tokens (-1: none), and every special token's id (never
    masked). Ships with the data as two small arrays (`token_meta`, `special_ids`)."""

    vocab_size: int
    pad_id: int = 0
    mask_id: int = -1
    eos_id: int = -1
    special_ids: tuple[int, ...] = ()

    def arrays(self) -> dict[str, np.ndarray]:
        """The meta as arrays to ship."""
        return {"token_meta": np.asarray([self.vocab_size, self.pad_id, self.mask_id,
                                          self.eos_id], dtype=np.int64),
                "special_ids": np.asarray(self.special_ids, dtype=np.int64)}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> TokenMeta | None:
        """The meta shipped in `arrays` (None: none shipped); `DataError` if malformed."""
        m = arrays.get("token_meta")
        if m is None:
            return None
        if m.shape != (4,):
            raise DataError(f"the data's token_meta has shape {m.shape}, not (4,)")
        vocab, pad, mask, eos = (int(x) for x in m)
        specials = arrays.get("special_ids", np.zeros(0, np.int64))
        if specials.ndim != 1 or specials.size > 4096:
            raise DataError("the data's special_ids must be 1-D, at most 4096 ids")
        if not 0 < vocab < (1 << 31) or not all(-1 <= x < vocab for x in (pad, mask, eos)):
            raise DataError(f"the data's token_meta {list(m)} is not a vocabulary and ids in it")
        return cls(vocab, pad, mask, eos, tuple(int(x) for x in specials))


BYTES_META = TokenMeta(256)
"""Byte-level text: 256 ids, padding with 0, no mask or end-of-text token."""


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


def read_corpus(root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The bytes of a text corpus (its files in sorted order, at most `max_bytes`)."""
    chunks: list[bytes] = []
    total = 0
    for f in text_files(root):
        try:
            data = f.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {f}: {e.strerror}") from e
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


@functools.lru_cache(maxsize=4)
def _load_tokens(root: str, tokenizer: str, max_bytes: int) -> np.ndarray:
    """Tokenize the corpus once per process (cached): a flat int64 token array."""
    raw = read_corpus(Path(root), max_bytes)
    if tokenizer == "bytes":
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    from fusiond.train.readers import open_tokenizer

    tok = open_tokenizer(tokenizer)
    ids = tok.encode_batch([raw.decode("utf-8", errors="replace")], specials=False)[0]
    return np.asarray(ids, dtype=np.int64)


def corpus_digest(tokens: np.ndarray) -> str:
    """Content hash of a token array (xxh3-128 of its int64 little-endian bytes): equal on two
    machines iff they would train on the same tokens."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(tokens, dtype="<i8").tobytes())


def dataset_digest(arrays: Mapping[str, np.ndarray]) -> str:
    """Content hash of a job's data arrays: a token stream alone hashes as `corpus_digest` (so
    a stage's own default corpus compares with the submitter's); anything else hashes every
    array's name, dtype, shape and bytes, in name order."""
    import xxhash

    if set(arrays) == {"tokens"}:
        return corpus_digest(arrays["tokens"])
    h = xxhash.xxh3_128()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def check_arrays(arrays: Mapping[str, np.ndarray], what: str) -> None:
    """`DataError` unless `arrays` is a job's data as a submitter ships it: known names, plain
    dtypes, at most 4 dimensions, at most `MAX_DATA_BYTES` in all."""
    total = 0
    for name, a in arrays.items():
        if name not in _ARRAY_NAMES:
            raise DataError(f"{what}: unknown data array {name!r} (known: {sorted(_ARRAY_NAMES)})")
        if a.dtype not in _ARRAY_DTYPES or a.ndim > 4 or a.ndim < 1:
            raise DataError(f"{what}: data array {name!r} is {a.dtype} with {a.ndim} dimensions "
                            "(want uint8/int32/int64/float32, 1 to 4 dimensions)")
        total += a.nbytes
    if total > MAX_DATA_BYTES:
        raise DataError(f"{what}: the data arrays hold {total} bytes, more than "
                        f"{MAX_DATA_BYTES}")


def text_tokens(spec: DataSpec) -> np.ndarray:
    """The token array of a text-files data spec (what a submitter ships to machines lacking
    it)."""
    assert spec.kind == "text" and spec.path is not None
    return _load_tokens(str(spec.path), spec.tokenizer, DEFAULT_MAX_BYTES)


def _mask_tokens(ids: np.ndarray, real: np.ndarray, rng: np.random.Generator, *,
                 p: float, meta: TokenMeta, ignore: int) -> tuple[np.ndarray, np.ndarray]:
    """BERT-style masking: each real, non-special position is chosen with probability `p`
    (at least one per row that has one); a chosen position becomes the mask token (80 %), a
    random token (10 %) or stays (10 %), and is the only kind of position with a label."""
    cand = real.copy()
    if meta.special_ids:
        cand &= ~np.isin(ids, np.asarray(meta.special_ids))
    chosen = (rng.random(ids.shape) < p) & cand
    none = ~chosen.any(axis=1) & cand.any(axis=1)
    for r in np.flatnonzero(none):  # every row teaches something: one position at least
        chosen[r, rng.choice(np.flatnonzero(cand[r]))] = True
    labels = np.where(chosen, ids, ignore)
    roll = rng.random(ids.shape)
    out = ids.copy()
    out[chosen & (roll < 0.8)] = meta.mask_id
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    out[swap] = rng.integers(0, meta.vocab_size, size=int(swap.sum()))
    return out, labels


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


class TextWindows:
    """Random windows of `seq_len + 1` tokens from a token stream.

    Causal LM (the default): `input_ids` are the first `seq_len` tokens of a window and
    `labels` the next token at each position. Masked LM: `input_ids` are `seq_len` tokens with
    some masked and `labels` the original token there (`ignore_index` elsewhere).
    The offsets of step `s` come from `numpy.random.default_rng([seed, s])`: a pure function
    of the seed and the step. With `heldout` > 0 the stream's tail (that fraction of it, at
    least one window) is never drawn for training: `heldout_batches` are windows over it.
    """

    def __init__(self, path: Path | None, *, seq_len: int, seed: int, tokenizer: str = "bytes",
                 max_bytes: int = DEFAULT_MAX_BYTES, tokens: np.ndarray | None = None,
                 heldout: float = 0.0, objective: str = "causal_lm",
                 meta: TokenMeta | None = None, mask_probability: float = 0.15,
                 ignore_index: int = -100) -> None:
        if tokens is None:
            if path is None:
                raise DataError("a text source needs a path or its tokens")
            tokens = _load_tokens(str(path), tokenizer, max_bytes)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.seq_len = seq_len
        self.seed = seed
        self.objective = objective
        self.meta = meta or BYTES_META
        self.mask_probability = mask_probability
        self.ignore_index = ignore_index
        where = path or "(shipped)"
        if self.tokens.ndim != 1 or self.tokens.size < seq_len + 2:
            raise DataError(
                f"corpus {where} has {self.tokens.size} tokens, needs more than "
                f"seq_len+1={seq_len + 1}"
            )
        span = seq_len + 1
        held = 0 if heldout <= 0 else max(span, round(heldout * self.tokens.size))
        self.train_tokens = self.tokens.size - held
        if self.train_tokens < seq_len + 2:
            raise DataError(
                f"corpus {where} has {self.tokens.size} tokens: holding out {held} of them "
                f"(data.heldout = {heldout}) leaves too few for windows of {span}; give more "
                "text or a smaller data.heldout")
        if objective == "masked_lm" and self.meta.mask_id < 0:
            raise DataError("masked LM needs a mask token: the tokenizer has none; set "
                            "loss.mask_token_id")
        self.vocab_size = int(self.tokens.max()) + 1

    def _fields(self, win: np.ndarray, rng: np.random.Generator) -> Batch:
        if self.objective == "masked_lm":
            ids = win[:, :-1]
            real = np.ones(ids.shape, dtype=bool)
            masked, labels = _mask_tokens(ids, real, rng, p=self.mask_probability,
                                          meta=self.meta, ignore=self.ignore_index)
            return Batch(fields={"input_ids": _t(masked), "labels": _t(labels)},
                         primary="input_ids", target="labels")
        t = torch.from_numpy(win)
        return Batch(fields={"input_ids": t[:, :-1].contiguous(),
                             "labels": t[:, 1:].contiguous()},
                     primary="input_ids", target="labels")

    def batch(self, step: int, size: int) -> Batch:
        """The deterministic batch of `step`."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.train_tokens - self.seq_len - 1, size=size)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return self._fields(self.tokens[idx], rng)

    def heldout_batches(self, size: int) -> Iterator[Batch]:
        """Non-overlapping windows over the held-out tail, `size` at a time (nothing without a
        held-out split)."""
        span = self.seq_len + 1
        count = min(MAX_HELDOUT_EXAMPLES, (self.tokens.size - self.train_tokens) // span)
        starts = self.train_tokens + np.arange(count) * span
        for i, lo in enumerate(range(0, count, size)):
            idx = starts[lo:lo + size, None] + np.arange(span)[None, :]
            yield self._fields(self.tokens[idx], np.random.default_rng([HELDOUT_SEED, i]))


class TextRows:
    """One example per record: `input_ids` (N, T) with each row's `lengths`, padded here.

    Every batch has `input_ids`, `attention_mask` (1 on the row's tokens), `token_type_ids`
    when the data has a second segment (`type_ids`), and `labels` by objective:
    causal LM: the next token (`ignore_index` at the last position and the pads);
    masked LM: the original token at masked positions; seq2seq: the target text
    (`target_ids`, `target_lengths`; `ignore_index` at its pads) with `decoder_input_ids`, the
    target shifted right behind the decoder start token; classification / regression: the
    record's label (`labels`, int64 or float32).
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], *, spec: DataSpec, seed: int,
                 meta: TokenMeta) -> None:
        ids = arrays.get("input_ids")
        lengths = arrays.get("lengths")
        if ids is None or lengths is None or ids.ndim != 2 or lengths.shape != ids.shape[:1]:
            raise DataError("row data needs input_ids (N, T) and lengths (N,)")
        self.ids = ids
        self.lengths = np.minimum(lengths.astype(np.int64), ids.shape[1])
        self.type_ids = arrays.get("type_ids")
        self.labels = arrays.get("labels")
        self.target_ids = arrays.get("target_ids")
        self.target_lengths = arrays.get("target_lengths")
        self.spec = spec
        self.seed = seed
        self.meta = meta
        self.objective = spec.objective
        n = ids.shape[0]
        if self.objective in ("classification", "regression") and (
                self.labels is None or self.labels.shape != (n,)):
            raise DataError(f"{self.objective} rows need one label per row")
        if self.objective == "seq2seq_lm" and (
                self.target_ids is None or self.target_lengths is None
                or self.target_ids.shape[0] != n or self.target_lengths.shape != (n,)):
            raise DataError("seq2seq rows need target_ids (N, T) and target_lengths (N,)")
        if self.type_ids is not None and self.type_ids.shape != ids.shape:
            raise DataError("type_ids must have the shape of input_ids")
        if self.objective == "masked_lm" and meta.mask_id < 0:
            raise DataError("masked LM needs a mask token: the tokenizer has none; set "
                            "loss.mask_token_id")
        self.train_idx, self.held_idx = split_indices(n, spec.heldout)
        if self.train_idx.size == 0:
            raise DataError("the data has no examples to train on")
        start = spec.decoder_start_token_id
        self.decoder_start = meta.pad_id if start is None else start

    def _fields(self, idx: np.ndarray, rng: np.random.Generator) -> Batch:
        ii = self.spec.ignore_index
        pad = max(self.meta.pad_id, 0)
        ids = self.ids[idx].astype(np.int64)
        width = ids.shape[1]
        real = np.arange(width)[None, :] < self.lengths[idx][:, None]
        ids[~real] = pad
        fields: dict[str, torch.Tensor] = {}
        if self.objective == "masked_lm":
            masked, labels = _mask_tokens(ids, real, rng, p=self.spec.mask_probability,
                                          meta=self.meta, ignore=ii)
            fields["input_ids"] = _t(masked)
        else:
            fields["input_ids"] = _t(ids)
        fields["attention_mask"] = _t(real.astype(np.int64))
        if self.type_ids is not None:
            fields["token_type_ids"] = _t(np.where(real, self.type_ids[idx], 0).astype(np.int64))
        if self.objective == "causal_lm":
            labels = np.full_like(ids, ii)
            labels[:, :-1] = np.where(real[:, 1:], ids[:, 1:], ii)
        elif self.objective == "seq2seq_lm":
            assert self.target_ids is not None and self.target_lengths is not None
            tgt = self.target_ids[idx].astype(np.int64)
            tw = tgt.shape[1]
            treal = np.arange(tw)[None, :] < self.target_lengths[idx][:, None]
            labels = np.where(treal, tgt, ii)
            dec = np.full_like(tgt, pad)
            dec[:, 0] = self.decoder_start
            dec[:, 1:] = np.where(treal[:, :-1], tgt[:, :-1], pad)
            fields["decoder_input_ids"] = _t(dec)
        elif self.objective in ("classification", "regression"):
            assert self.labels is not None
            dtype = np.float32 if self.objective == "regression" else np.int64
            labels = self.labels[idx].astype(dtype)
        fields["labels"] = _t(labels)
        return Batch(fields=fields, primary="input_ids", target="labels")

    def batch(self, step: int, size: int) -> Batch:
        """The deterministic batch of `step`: rows drawn from the training split."""
        rng = np.random.default_rng([self.seed, step])
        pick = self.train_idx[rng.integers(0, self.train_idx.size, size=size)]
        return self._fields(pick, rng)

    def heldout_batches(self, size: int) -> Iterator[Batch]:
        """The held-out rows, `size` at a time (masking seeded by `HELDOUT_SEED`)."""
        held = self.held_idx[:MAX_HELDOUT_EXAMPLES]
        for i, lo in enumerate(range(0, held.size, size)):
            yield self._fields(held[lo:lo + size], np.random.default_rng([HELDOUT_SEED, i]))


class ImageArrays:
    """Decoded images `pixel_values` (N, C, H, W) uint8 and their class `labels` (N,).

    Per batch: to float in [0, 1], the random transforms of `spec.augment` (`hflip`: each
    image mirrored with probability 1/2; `crop`: padded by H/8 with zeros and cropped back at
    a random offset), then normalised by `spec.mean` / `spec.std` per channel.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], *, spec: DataSpec, seed: int) -> None:
        px, labels = arrays.get("pixel_values"), arrays.get("labels")
        if px is None or labels is None or px.ndim != 4 or labels.shape != px.shape[:1]:
            raise DataError("image data needs pixel_values (N, C, H, W) and labels (N,)")
        if px.dtype != np.uint8:
            raise DataError("image pixel_values must be uint8")
        self.pixels, self.labels = px, labels.astype(np.int64)
        self.spec, self.seed = spec, seed
        c = px.shape[1]
        self.mean = np.asarray(spec.mean or (0.5,) * c, np.float32).reshape(1, c, 1, 1)
        self.std = np.asarray(spec.std or (0.5,) * c, np.float32).reshape(1, c, 1, 1)
        if self.mean.size != c or self.std.size != c:
            raise DataError(f"data.mean / data.std need {c} values (one per channel)")
        self.num_classes = int(self.labels.max()) + 1 if self.labels.size else 0
        self.train_idx, self.held_idx = split_indices(px.shape[0], spec.heldout)
        if self.train_idx.size == 0:
            raise DataError("the image data has no examples to train on")

    def _fields(self, idx: np.ndarray, rng: np.random.Generator | None) -> Batch:
        x = self.pixels[idx].astype(np.float32) / np.float32(255.0)
        if rng is not None and "hflip" in self.spec.augment:
            flip = rng.random(len(idx)) < 0.5
            x[flip] = x[flip][..., ::-1]
        if rng is not None and "crop" in self.spec.augment:
            n, _, h, w = x.shape
            p = max(1, h // 8)
            padded = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
            dy, dx = rng.integers(0, 2 * p + 1, size=(2, n))
            x = np.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
        x = (x - self.mean) / self.std
        return Batch(fields={"pixel_values": _t(x.astype(np.float32)),
                             "labels": _t(self.labels[idx])},
                     primary="pixel_values", target="labels")

    def batch(self, step: int, size: int) -> Batch:
        """The deterministic batch of `step`."""
        rng = np.random.default_rng([self.seed, step])
        pick = self.train_idx[rng.integers(0, self.train_idx.size, size=size)]
        return self._fields(pick, rng)

    def heldout_batches(self, size: int) -> Iterator[Batch]:
        """The held-out images, untransformed, `size` at a time."""
        held = self.held_idx[:MAX_HELDOUT_EXAMPLES]
        for lo in range(0, held.size, size):
            yield self._fields(held[lo:lo + size], None)


class SyntheticImages:
    """Learnable synthetic images: a fixed random template per class plus per-sample noise.

    Templates come from `seed` alone; the samples of step `s` from `default_rng([seed, s])`;
    the held-out images from a stream no step draws.
    """

    def __init__(self, *, image_size: int, channels: int, num_classes: int, seed: int,
                 noise: float = 0.5) -> None:
        self.shape = (channels, image_size, image_size)
        self.num_classes = num_classes
        self.seed = seed
        self.noise = noise
        rng = np.random.default_rng([seed, 2**32 - 1])
        self.templates = rng.standard_normal((num_classes, *self.shape)).astype(np.float32)

    def _draw(self, rng: np.random.Generator, size: int) -> Batch:
        labels = rng.integers(0, self.num_classes, size=size)
        noise = rng.standard_normal((size, *self.shape)).astype(np.float32)
        images = self.templates[labels] + np.float32(self.noise) * noise
        return Batch(fields={"pixel_values": torch.from_numpy(images),
                             "labels": torch.from_numpy(labels.astype(np.int64))},
                     primary="pixel_values", target="labels")

    def batch(self, step: int, size: int) -> Batch:
        """The deterministic batch of `step`: float32 images (N, C, H, W), int64 labels."""
        return self._draw(np.random.default_rng([self.seed, step]), size)

    def heldout_batches(self, size: int, count: int = 256) -> Iterator[Batch]:
        """`count` held-out images, `size` at a time."""
        for i, lo in enumerate(range(0, count, size)):
            yield self._draw(np.random.default_rng([self.seed, HELDOUT_SEED, i]),
                             min(size, count - lo))


Source = TextWindows | TextRows | ImageArrays | SyntheticImages


def _meta(spec: DataSpec, arrays: Mapping[str, np.ndarray]) -> TokenMeta:
    meta = TokenMeta.from_arrays(arrays) or BYTES_META
    if spec.mask_token_id is not None:  # the job's own choice wins
        meta = replace(meta, mask_id=spec.mask_token_id,
                       vocab_size=max(meta.vocab_size, spec.mask_token_id + 1))
    return meta


def source_from_arrays(spec: DataSpec, arrays: Mapping[str, np.ndarray], seed: int) -> Source:
    """The data source of `spec` over the arrays its submitter read (what a stage builds from
    the data its Assign carries)."""
    if spec.kind == "images":
        return SyntheticImages(image_size=spec.image_size, channels=spec.channels,
                               num_classes=spec.num_classes, seed=seed)
    if spec.kind == "image_folder":
        return ImageArrays(arrays, spec=spec, seed=seed)
    meta = _meta(spec, arrays)
    if spec.layout == "windows":
        tokens = arrays.get("tokens")
        if tokens is None:
            raise DataError("a windows layout needs a token stream (tokens)")
        return TextWindows(spec.path, seq_len=spec.seq_len, seed=seed, tokens=tokens,
                           heldout=spec.heldout, objective=spec.objective, meta=meta,
                           mask_probability=spec.mask_probability,
                           ignore_index=spec.ignore_index)
    return TextRows(arrays, spec=spec, seed=seed, meta=meta)


def is_default_corpus(spec: DataSpec) -> bool:
    """Whether a job reads the default corpus (this Python's standard library, byte-level, as a
    token stream): every machine has it, so it is not shipped; each data stage reads its own
    and checks its hash."""
    return (spec.kind == "text" and spec.path is not None and spec.tokenizer == "bytes"
            and spec.layout == "windows" and spec.path.resolve() == default_text_path().resolve())


def compact_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays as shipped: a token stream as uint8 when its ids fit, else int32."""
    out = dict(arrays)
    tokens = out.get("tokens")
    if tokens is not None:
        small = tokens.size and int(tokens.max()) < 256 and int(tokens.min()) >= 0
        out["tokens"] = tokens.astype(np.uint8 if small else np.int32)
    return out


def load_arrays(spec: DataSpec) -> dict[str, np.ndarray]:
    """Read the data a spec names, here (the submitting machine), as arrays: what the stages
    that read data get. Synthetic images have none."""
    if spec.kind == "images":
        return {}
    if spec.kind == "text" and spec.layout == "windows":
        arrays: dict[str, np.ndarray] = {"tokens": text_tokens(spec)}
        if spec.tokenizer != "bytes":  # bytes: BYTES_META (and the job's mask_token_id)
            from fusiond.train.readers import tokenizer_meta

            arrays.update(tokenizer_meta(spec.tokenizer).arrays())
        return arrays
    from fusiond.train.readers import read_arrays

    return read_arrays(spec)


def make_source(spec: DataSpec, seed: int) -> Source:
    """Build the data source a job spec names, reading its data here."""
    return source_from_arrays(spec, load_arrays(spec), seed)
