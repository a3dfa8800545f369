"""Readers of the data a researcher has on disk, on the submitting machine only.

`read_arrays(spec)` turns a job's `[data]` into the arrays its data stages get
(`fusiond.train.data.source_from_arrays` builds the batches from them):

- text files or a directory (`kind = "text"`), JSON lines (`"jsonl"`: one object per line,
  the string `column`), Parquet (`"parquet"`: a file or a directory of `*.parquet`, read
  column by column with pyarrow) and a Hugging Face `datasets` dataset saved with
  `save_to_disk` (`"hf_dataset"`; a `DatasetDict`'s `split`, default "train"; read with the
  datasets library in offline mode: nothing is downloaded);
- tokenized by `open_tokenizer(data.tokenizer)`: bytes, a `tokenizers` JSON file, or a
  transformers tokenizer directory (`AutoTokenizer.from_pretrained(..., local_files_only=True)`);
- as a token stream (layout "windows": records joined by the tokenizer's end-of-text token) or
  as rows (layout "rows": each record truncated to `seq_len`, with its length; a second
  segment from `pair_column`, a label from `label_column`, a target text from
  `target_column`);
- image folders (`"image_folder"`: one subdirectory per class, sorted; each image decoded with
  Pillow, converted to RGB or greyscale, its shorter side resized to `image_size` and
  centre-cropped square), as uint8 arrays.

Everything is bounded: at most `DEFAULT_MAX_BYTES` of text (64 MiB) and of image files' bytes
per image, `data.max_examples` records, `MAX_DATA_BYTES` of arrays in all; a bad record is a
`DataError` naming the file, the line or row, the column and what to do.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusiond.train.data import (
    BYTES_META,
    DEFAULT_MAX_BYTES,
    MAX_DATA_BYTES,
    DataError,
    TokenMeta,
    check_arrays,
    read_corpus,
)
from fusiond.train.spec import DataSpec

__all__ = ["IMAGE_SUFFIXES", "TextTokenizer", "open_tokenizer", "read_arrays",
           "tokenizer_meta"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif",
                  ".tiff")
MAX_IMAGE_FILE_BYTES = 64 << 20
MAX_IMAGE_PIXELS = 64 << 20
"""An image with more pixels than this is refused before it is decoded (a decompression bomb)."""
_PAD = ("[PAD]", "<pad>", "<|pad|>", "<|padding|>")
_MASK = ("[MASK]", "<mask>", "<|mask|>")
_EOS = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]")


@contextmanager
def _offline() -> Iterator[None]:
    """Hugging Face libraries in offline mode: a reader never reaches a hub."""
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict.fromkeys(keys, "1"))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class TextTokenizer:
    """Bytes, a `tokenizers` JSON file, or a transformers tokenizer directory, behind one
    interface: `encode_batch(texts, pairs, max_len, specials)` -> (ids per text, type ids per
    text) and `meta`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.kind = "bytes"
        self._tok: Any = None
        self._hf: Any = None
        if name == "bytes":
            self.meta = BYTES_META
            return
        p = Path(name)
        try:
            if p.is_file():
                from tokenizers import Tokenizer

                self.kind = "tokenizers"
                self._tok = Tokenizer.from_file(str(p))
            else:
                from transformers import AutoTokenizer

                self.kind = "transformers"
                with _offline():
                    self._hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except ImportError as e:
            raise DataError(f"data.tokenizer {name}: needs the '{e.name}' package (pip install "
                            "'fusion[data]')") from e
        except Exception as e:
            raise DataError(f"data.tokenizer {name}: cannot load it as a tokenizers JSON file "
                            f"or a transformers tokenizer directory: {type(e).__name__}: "
                            f"{e}") from e
        self.meta = self._read_meta()

    def _read_meta(self) -> TokenMeta:
        if self._hf is not None:
            t = self._hf
            vocab = len(t)

            def hid(v: Any) -> int:
                return int(v) if isinstance(v, int) else -1

            return TokenMeta(vocab, max(0, hid(t.pad_token_id)), hid(t.mask_token_id),
                             hid(t.eos_token_id),
                             tuple(sorted({int(i) for i in t.all_special_ids})))
        tok = self._tok
        vocab = int(tok.get_vocab_size(with_added_tokens=True))

        def find(names: Sequence[str]) -> int:
            for n in names:
                i = tok.token_to_id(n)
                if i is not None:
                    return int(i)
            return -1

        specials = sorted({int(i) for i, a in _added_tokens(tok) if a.special})
        return TokenMeta(vocab, max(0, find(_PAD)), find(_MASK), find(_EOS), tuple(specials))

    def encode_batch(self, texts: Sequence[str], pairs: Sequence[str] | None = None, *,
                     max_len: int | None = None, specials: bool = True,
                     ) -> tuple[list[list[int]], list[list[int]]]:
        """Token ids (and segment ids: 0 for `texts`, 1 for `pairs`) of each text, with the
        tokenizer's special tokens when `specials`, truncated to `max_len` tokens."""
        if self.kind == "bytes":
            ids_out: list[list[int]] = []
            types: list[list[int]] = []
            for i, text in enumerate(texts):
                a = list(text.encode("utf-8"))
                b = list(pairs[i].encode("utf-8")) if pairs is not None else []
                ids = (a + b)[:max_len] if max_len else a + b
                ids_out.append(ids)
                types.append(([0] * len(a) + [1] * len(b))[:len(ids)])
            return ids_out, types
        if self._hf is not None:
            kwargs: dict[str, Any] = {"add_special_tokens": specials,
                                      "return_token_type_ids": True}
            if max_len:
                kwargs.update(truncation=True, max_length=max_len)
            enc = self._hf(list(texts), list(pairs), **kwargs) if pairs is not None else \
                self._hf(list(texts), **kwargs)
            ids_hf = [list(x) for x in enc["input_ids"]]
            tt = enc.get("token_type_ids") or [[0] * len(x) for x in ids_hf]
            return ids_hf, [list(x) for x in tt]
        tok = self._tok
        if max_len:
            tok.enable_truncation(max_length=max_len)
        else:
            tok.no_truncation()
        batch = list(zip(texts, pairs)) if pairs is not None else list(texts)
        encs = tok.encode_batch(batch, add_special_tokens=specials)
        return [list(e.ids) for e in encs], [list(e.type_ids) for e in encs]


def _added_tokens(tok: Any) -> list[tuple[int, Any]]:
    try:
        return list(tok.get_added_tokens_decoder().items())
    except AttributeError:  # pragma: no cover - an older tokenizers
        return []


@functools.lru_cache(maxsize=4)
def open_tokenizer(name: str) -> TextTokenizer:
    """The tokenizer a job names (cached per process)."""
    return TextTokenizer(name)


def tokenizer_meta(name: str) -> TokenMeta:
    """The pad / mask / end-of-text ids and vocabulary size of a tokenizer."""
    return open_tokenizer(name).meta


# -- records ------------------------------------------------------------------------------------


@dataclass
class _Records:
    """Columns of a text source as Python lists (bounded)."""

    text: list[str]
    pair: list[str] | None
    label: list[Any] | None
    target: list[str] | None
    where: list[str]
    """Each record's location for errors (`file:line`, `row N`)."""


def _needed(spec: DataSpec) -> tuple[bool, bool, bool]:
    """Whether a source must give (a pair, a label, a target) per record."""
    return (spec.pair_column is not None,
            spec.objective in ("classification", "regression"),
            spec.objective == "seq2seq_lm")


class _Collector:
    """Appends records, checking each column's type and the bounds."""

    def __init__(self, spec: DataSpec, source: str) -> None:
        self.spec = spec
        self.source = source
        pair, label, target = _needed(spec)
        self.rec = _Records([], [] if pair else None, [] if label else None,
                            [] if target else None, [])
        self.bytes = 0

    @property
    def full(self) -> bool:
        return len(self.rec.text) >= self.spec.max_examples or self.bytes >= DEFAULT_MAX_BYTES

    def _str(self, row: Any, col: str, where: str) -> str:
        if col not in row:
            raise DataError(f"{self.source}: {where} has no column {col!r} (it has "
                            f"{sorted(row)[:8]}); set data.column / data.pair_column / "
                            "data.target_column to the right names")
        v = row[col]
        if not isinstance(v, str):
            raise DataError(f"{self.source}: {where}: column {col!r} is "
                            f"{type(v).__name__}, not text")
        self.bytes += len(v)
        return v

    def add(self, row: Any, where: str) -> None:
        s, r = self.spec, self.rec
        r.text.append(self._str(row, s.column, where))
        if r.pair is not None:
            assert s.pair_column is not None
            r.pair.append(self._str(row, s.pair_column, where))
        if r.target is not None:
            r.target.append(self._str(row, s.target_column, where))
        if r.label is not None:
            if s.label_column not in row:
                raise DataError(f"{self.source}: {where} has no label column "
                                f"{s.label_column!r} (it has {sorted(row)[:8]}); set "
                                "data.label_column")
            v = row[s.label_column]
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool)) if \
                s.objective == "regression" else isinstance(v, (int, str)) and \
                not isinstance(v, bool)
            if not ok or (isinstance(v, float) and v != v):
                want = "a number" if s.objective == "regression" else "an integer class or a " \
                    "class name"
                raise DataError(f"{self.source}: {where}: label {v!r} in column "
                                f"{s.label_column!r} is not {want}")
            r.label.append(v)
        r.where.append(where)


def _jsonl(spec: DataSpec) -> _Records:
    assert spec.path is not None
    files = [spec.path] if spec.path.is_file() else sorted(
        p for p in spec.path.rglob("*") if p.suffix in (".jsonl", ".json", ".ndjson")
        and p.is_file())
    if not files:
        raise DataError(f"data.path {spec.path}: no .jsonl files")
    col = _Collector(spec, f"data.path {spec.path}")
    for f in files:
        try:
            fh = f.open("rb")
        except OSError as e:
            raise DataError(f"cannot read {f}: {e.strerror}") from e
        with fh:
            for n, line in enumerate(fh, 1):
                if col.full:
                    break
                if len(line) > DEFAULT_MAX_BYTES:
                    raise DataError(f"{f}:{n}: a line of {len(line)} bytes")
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{f}:{n}: not valid JSON ({e}); a JSON-lines file holds "
                                    "one object per line") from None
                if not isinstance(row, dict):
                    raise DataError(f"{f}:{n}: a {type(row).__name__}, not a JSON object")
                col.add(row, f"{f.name}:{n}")
        if col.full:
            break
    return col.rec


def _columns(spec: DataSpec) -> list[str]:
    pair, label, target = _needed(spec)
    cols = [spec.column]
    if pair:
        assert spec.pair_column is not None
        cols.append(spec.pair_column)
    if label:
        cols.append(spec.label_column)
    if target:
        cols.append(spec.target_column)
    return cols


def _parquet(spec: DataSpec) -> _Records:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError("data.kind = 'parquet' needs the 'pyarrow' package (pip install "
                        "'fusion[data]')") from e
    assert spec.path is not None
    files = [spec.path] if spec.path.is_file() else sorted(spec.path.rglob("*.parquet"))
    if not files:
        raise DataError(f"data.path {spec.path}: no .parquet files")
    col = _Collector(spec, f"data.path {spec.path}")
    want = list(dict.fromkeys(_columns(spec)))
    for f in files:
        try:
            pf = pq.ParquetFile(str(f))
        except Exception as e:
            raise DataError(f"{f}: not a Parquet file: {e}") from e
        names = pf.schema_arrow.names
        missing = [c for c in want if c not in names]
        if missing:
            raise DataError(f"{f}: no column {missing[0]!r} (it has {names[:8]}); set "
                            "data.column / data.label_column / data.target_column")
        row0 = 0
        for rg in range(pf.num_row_groups):
            if col.full:
                break
            table = pf.read_row_group(rg, columns=want).to_pydict()
            for i in range(len(table[want[0]])):
                if col.full:
                    break
                col.add({c: table[c][i] for c in want}, f"{f.name} row {row0 + i}")
            row0 += len(table[want[0]])
    return col.rec


def _hf_dataset(spec: DataSpec) -> _Records:
    try:
        import datasets
    except ImportError as e:
        raise DataError("data.kind = 'hf_dataset' needs the 'datasets' package (pip install "
                        "'fusion[data]')") from e
    assert spec.path is not None
    with _offline():
        try:
            ds = datasets.load_from_disk(str(spec.path))
        except Exception as e:
            raise DataError(f"data.path {spec.path}: not a dataset saved with save_to_disk: "
                            f"{type(e).__name__}: {e}") from e
        if isinstance(ds, datasets.DatasetDict):
            split = spec.split or "train"
            if split not in ds:
                raise DataError(f"data.path {spec.path}: no split {split!r} (it has "
                                f"{sorted(ds)}); set data.split")
            ds = ds[split]
        elif spec.split is not None:
            raise DataError(f"data.split = {spec.split!r}, but {spec.path} holds one split "
                            "(a Dataset, not a DatasetDict): remove data.split")
        want = list(dict.fromkeys(_columns(spec)))
        missing = [c for c in want if c not in ds.column_names]
        if missing:
            raise DataError(f"data.path {spec.path}: no column {missing[0]!r} (it has "
                            f"{ds.column_names[:8]}); set data.column / data.label_column / "
                            "data.target_column")
        col = _Collector(spec, f"data.path {spec.path}")
        row0 = 0
        for chunk in ds.select_columns(want).iter(batch_size=1024):
            n = len(chunk[want[0]])
            for i in range(n):
                if col.full:
                    break
                col.add({c: chunk[c][i] for c in want}, f"row {row0 + i}")
            row0 += n
            if col.full:
                break
    return col.rec


def _text_lines(spec: DataSpec) -> _Records:
    assert spec.path is not None
    raw = read_corpus(spec.path).decode("utf-8", errors="replace")
    lines = [ln for ln in (x.strip() for x in raw.splitlines()) if ln][:spec.max_examples]
    return _Records(lines, None, None, None, [f"line {i + 1}" for i in range(len(lines))])


def _records(spec: DataSpec) -> _Records:
    if spec.kind == "jsonl":
        rec = _jsonl(spec)
    elif spec.kind == "parquet":
        rec = _parquet(spec)
    elif spec.kind == "hf_dataset":
        rec = _hf_dataset(spec)
    else:
        rec = _text_lines(spec)
    if not rec.text:
        raise DataError(f"data.path {spec.path}: no records")
    return rec


def _pack(rows: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of token ids as (N, width) int32 (zeros past each row) and their lengths."""
    out = np.zeros((len(rows), max(1, width)), dtype=np.int32)
    lengths = np.zeros(len(rows), dtype=np.int32)
    for i, r in enumerate(rows):
        r = r[:width]
        out[i, :len(r)] = r
        lengths[i] = len(r)
    return out, lengths


def _labels(spec: DataSpec, rec: _Records) -> np.ndarray:
    assert rec.label is not None
    if spec.objective == "regression":
        return np.asarray(rec.label, dtype=np.float32)
    if all(isinstance(v, str) for v in rec.label):  # class names -> indices, sorted
        names = sorted(set(rec.label))
        index = {n: i for i, n in enumerate(names)}
        return np.asarray([index[v] for v in rec.label], dtype=np.int64)
    if not all(isinstance(v, int) for v in rec.label):
        raise DataError(f"data.label_column {spec.label_column!r} mixes class names and "
                        "numbers")
    labels = np.asarray(rec.label, dtype=np.int64)
    if labels.min() < 0:
        bad = int(np.argmin(labels))
        raise DataError(f"{rec.where[bad]}: class {int(labels[bad])} is negative")
    return labels


def _text_arrays(spec: DataSpec) -> dict[str, np.ndarray]:
    rec = _records(spec)
    tok = open_tokenizer(spec.tokenizer)
    arrays: dict[str, np.ndarray] = {}
    if spec.layout == "windows":
        ids, _ = tok.encode_batch(rec.text, specials=False)
        eos = tok.meta.eos_id
        stream: list[int] = []
        for r in ids:
            stream.extend(r)
            if eos >= 0:
                stream.append(eos)
        dtype = np.uint8 if stream and max(stream) < 256 else np.int32
        arrays["tokens"] = np.asarray(stream, dtype=dtype)
    else:
        ids, types = tok.encode_batch(rec.text, rec.pair, max_len=spec.seq_len)
        arrays["input_ids"], arrays["lengths"] = _pack(ids, spec.seq_len)
        if rec.pair is not None:
            arrays["type_ids"] = _pack(types, spec.seq_len)[0].astype(np.uint8)
        if rec.target is not None:
            tids, _ = tok.encode_batch(rec.target, max_len=spec.targets_len)
            arrays["target_ids"], arrays["target_lengths"] = _pack(tids, spec.targets_len)
        if rec.label is not None:
            arrays["labels"] = _labels(spec, rec)
        _drop_empty(spec, arrays, tok.meta)
    arrays.update(tok.meta.arrays())
    return arrays


def _drop_empty(spec: DataSpec, arrays: dict[str, np.ndarray], meta: TokenMeta) -> None:
    """Leave out the rows that would teach nothing (all their labels `ignore_index`: a causal
    row of fewer than 2 tokens, a masked-LM row of special tokens only, an empty target), so
    no micro-batch's loss is 0/0."""
    ids, lengths = arrays["input_ids"], arrays["lengths"]
    keep: np.ndarray
    if spec.objective == "causal_lm":
        keep = np.asarray(lengths >= 2)
    elif spec.objective == "masked_lm":
        real: np.ndarray = np.arange(ids.shape[1])[None, :] < lengths[:, None]
        if meta.special_ids:
            real = np.asarray(real & ~np.isin(ids, np.asarray(meta.special_ids)), dtype=bool)
        keep = np.asarray(real.any(axis=1))
    elif spec.objective == "seq2seq_lm":
        keep = np.asarray(arrays["target_lengths"] >= 1)
    else:
        return
    if not keep.any():
        raise DataError(f"data.path {spec.path}: no record has anything to predict for "
                        f"loss.kind = {spec.objective!r} (too short or empty)")
    if not keep.all():
        for k in list(arrays):
            arrays[k] = arrays[k][keep]


def _image_folder(spec: DataSpec) -> dict[str, np.ndarray]:
    try:
        from PIL import Image
    except ImportError as e:
        raise DataError("data.kind = 'image_folder' needs the 'pillow' package (pip install "
                        "'fusion[data]')") from e
    root = spec.path
    assert root is not None
    if not root.is_dir():
        raise DataError(f"data.path {root}: not a directory (an image folder holds one "
                        "subdirectory per class)")
    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(classes) < 2:
        raise DataError(f"data.path {root}: {len(classes)} class directories; an image folder "
                        "holds one subdirectory per class, at least 2")
    size, c = spec.image_size, spec.channels
    if c not in (1, 3):
        raise DataError(f"data.channels = {c}: an image folder decodes to 1 (greyscale) or 3 "
                        "(RGB) channels")
    per = c * size * size
    cap = min(spec.max_examples, MAX_DATA_BYTES // per)
    files: list[tuple[Path, int]] = []
    for k, d in enumerate(classes):
        found = sorted(p for p in d.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES
                       and p.is_file())
        if not found:
            raise DataError(f"class directory {d} holds no images ({', '.join(IMAGE_SUFFIXES)})")
        files.extend((p, k) for p in found)
    if len(files) > cap:
        raise DataError(f"data.path {root}: {len(files)} images of {c}x{size}x{size} are more "
                        f"than {cap} (data.max_examples, or {MAX_DATA_BYTES >> 20} MiB of "
                        "pixels); use a smaller data.image_size or fewer images")
    pixels = np.zeros((len(files), c, size, size), dtype=np.uint8)
    labels = np.zeros(len(files), dtype=np.int64)
    for i, (p, k) in enumerate(files):
        try:
            if p.stat().st_size > MAX_IMAGE_FILE_BYTES:
                raise DataError(f"{p}: larger than {MAX_IMAGE_FILE_BYTES >> 20} MiB")
            with Image.open(p) as f:
                if f.width * f.height > MAX_IMAGE_PIXELS:
                    raise DataError(f"{p}: {f.width}x{f.height} pixels, more than "
                                    f"{MAX_IMAGE_PIXELS}")
                im = f.convert("RGB" if c == 3 else "L")
            scale = size / min(im.width, im.height)
            w, h = max(size, round(im.width * scale)), max(size, round(im.height * scale))
            im = im.resize((w, h), Image.Resampling.BILINEAR)
            left, top = (w - size) // 2, (h - size) // 2
            im = im.crop((left, top, left + size, top + size))
            a = np.asarray(im, dtype=np.uint8)
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{p}: cannot decode the image ({type(e).__name__}: {e}); remove "
                            "it or convert it") from e
        pixels[i] = a[None] if c == 1 else a.transpose(2, 0, 1)
        labels[i] = k
    if spec.num_classes != 10 and spec.num_classes != len(classes):  # 10: the default
        raise DataError(f"data.num_classes = {spec.num_classes}, but {root} has "
                        f"{len(classes)} class directories")
    return {"pixel_values": pixels, "labels": labels}


@functools.lru_cache(maxsize=4)
def read_arrays(spec: DataSpec) -> dict[str, np.ndarray]:
    """The arrays of a data spec's source, read here (cached per process)."""
    if spec.kind == "image_folder":
        arrays = _image_folder(spec)
    else:
        arrays = _text_arrays(spec)
    check_arrays(arrays, f"data.path {spec.path}")
    return arrays
