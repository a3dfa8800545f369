"""Data sources on disk and the objectives' batches (issue 20): JSON lines, Parquet, a saved
`datasets` dataset and text files read into the same rows; tokenizers from a JSON file or a
transformers directory; image folders; masked-LM masking, next-token and seq2seq labels made in
the data path, deterministic per step; every source's held-out split kept out of training; and
every bad input refused naming the file, the record and what to do."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fusiond.errors import RemoteError
from fusiond.train.data import (
    DataError,
    ImageArrays,
    TextRows,
    TextWindows,
    check_arrays,
    dataset_digest,
    load_arrays,
    make_source,
    split_indices,
)
from fusiond.train.readers import open_tokenizer
from fusiond.train.spec import JobSpec, JobSpecError, parse_job
from tests import datafiles

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock

HEAD = '[job]\nsteps = 2\n[batch]\nsize = 4\nmicro_batches = 2\n[model]\nzoo = "gpt2"\n'


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sources")
    recs = datafiles.sentences(120)
    recs[3]["label"] = 5
    datafiles.write_jsonl(root / "d.jsonl", recs)
    datafiles.write_parquet(root / "d.parquet", recs)
    datafiles.save_dataset(root / "ds", recs)
    datafiles.train_tokenizer(recs, root / "tok.json")
    datafiles.transformers_tokenizer(root / "tok.json", root / "toktf")
    datafiles.image_folder(root / "img", classes=3, per_class=6)
    (root / "lines.txt").write_text("".join(str(r["text"]) + "\n" for r in recs))
    return root


def _spec(d: Path, data: str, loss: str = "") -> JobSpec:
    return parse_job(HEAD + "[data]\n" + data + ("[loss]\n" + loss if loss else ""), base=d)


def test_objective_names_and_defaults() -> None:
    spec = parse_job(HEAD)
    assert spec.loss.kind == "causal_lm" and spec.data.layout == "windows"
    assert spec.data.heldout == 0.05 and spec.loss.ignore_index == -100
    for old, new in (("lm_cross_entropy", "causal_lm"), ("cross_entropy", "classification"),
                     ("mse", "regression")):
        kind = "images" if new != "causal_lm" else "text"
        assert parse_job(HEAD + f'[data]\nkind = "{kind}"\n[loss]\nkind = "{old}"\n'
                         ).loss.kind == new
    assert parse_job(HEAD + '[data]\nkind = "images"\n').loss.kind == "classification"
    mlm = parse_job(HEAD + '[loss]\nkind = "masked_lm"\nmask_probability = 0.3\n')
    assert mlm.data.layout == "rows" and mlm.data.mask_probability == 0.3
    assert mlm.data.objective == "masked_lm"


def test_every_text_source_reads_the_same_rows(d: Path) -> None:
    """JSON lines, Parquet, a saved dataset and text lines give the same token rows; a
    tokenizers JSON file and its transformers directory the same ids."""
    common = 'tokenizer = "tok.json"\nseq_len = 16\n'
    got = {}
    for kind, path in (("jsonl", "d.jsonl"), ("parquet", "d.parquet"), ("hf_dataset", "ds"),
                       ("text", "lines.txt")):
        spec = _spec(d, f'kind = "{kind}"\npath = "{path}"\n{common}', 'kind = "masked_lm"\n')
        got[kind] = load_arrays(spec.data)
    ref = got["jsonl"]
    assert ref["input_ids"].shape == (120, 16)
    for kind, arrays in got.items():
        assert np.array_equal(arrays["input_ids"], ref["input_ids"]), kind
        assert dataset_digest(arrays) == dataset_digest(ref), kind
    tf = load_arrays(_spec(d, 'kind = "jsonl"\npath = "d.jsonl"\ntokenizer = "toktf"\n'
                              'seq_len = 16\n', 'kind = "masked_lm"\n').data)
    assert np.array_equal(tf["input_ids"], ref["input_ids"])
    tok = open_tokenizer(str(d / "tok.json"))
    assert tok.meta.mask_id >= 0 and tok.meta.pad_id == 0
    assert set(tok.meta.special_ids) == {0, 1, 2, 3, 4}


def test_masked_lm_masks_real_tokens_in_the_data_path(d: Path) -> None:
    spec = _spec(d, 'kind = "jsonl"\npath = "d.jsonl"\ntokenizer = "tok.json"\nseq_len = 16\n',
                 'kind = "masked_lm"\n')
    src = make_source(spec.data, seed=3)
    assert isinstance(src, TextRows)
    b = src.batch(5, 64)
    assert set(b.fields) == {"input_ids", "attention_mask", "labels"}
    ids, mask, labels = b["input_ids"], b["attention_mask"].bool(), b["labels"]
    chosen = labels != -100
    assert bool((chosen.sum(1) >= 1).all())  # every row teaches something
    assert not bool((chosen & ~mask).any())  # never a pad
    meta = src.meta
    specials = torch.tensor(meta.special_ids)
    assert not bool(torch.isin(labels[chosen], specials).any())  # never [CLS] / [SEP]
    eligible = int(mask.sum()) - 2 * ids.shape[0]  # all real tokens but [CLS] and [SEP]
    # 15 %, and one at least in every (short) row
    assert 0.12 < int(chosen.sum()) / eligible < 0.3
    assert float((ids[chosen] == meta.mask_id).float().mean()) > 0.6  # most become [MASK]
    again = src.batch(5, 64)
    assert all(torch.equal(again[k], b[k]) for k in b.fields)  # a function of (seed, step)
    assert not torch.equal(src.batch(6, 64)["labels"], labels)


def test_causal_and_seq2seq_rows_make_their_labels(d: Path) -> None:
    causal = make_source(_spec(d, 'kind = "jsonl"\npath = "d.jsonl"\ntokenizer = "tok.json"\n'
                                  'seq_len = 16\nlayout = "rows"\n').data, seed=0)
    b = causal.batch(0, 8)
    ids, mask, labels = b["input_ids"], b["attention_mask"], b["labels"]
    for r in range(8):
        n = int(mask[r].sum())
        assert torch.equal(labels[r, :n - 1], ids[r, 1:n])  # the next token
        assert bool((labels[r, n - 1:] == -100).all())  # nothing after the last real one
    s2s = make_source(_spec(d, 'kind = "parquet"\npath = "d.parquet"\ntokenizer = "tok.json"\n'
                               'seq_len = 16\ntarget_column = "summary"\ntarget_len = 6\n'
                               'decoder_start_token_id = 2\n',
                            'kind = "seq2seq_lm"\n').data, seed=0)
    b = s2s.batch(0, 8)
    dec, labels = b["decoder_input_ids"], b["labels"]
    assert dec.shape == labels.shape == (8, 6)
    assert bool((dec[:, 0] == 2).all())
    real = labels != -100
    assert torch.equal(dec[:, 1:][real[:, :-1]], labels[:, :-1][real[:, :-1]])  # shifted right


def test_classification_and_regression_labels(d: Path, tmp_path: Path) -> None:
    cls = make_source(_spec(d, 'kind = "hf_dataset"\npath = "ds"\ntokenizer = "tok.json"\n'
                               'seq_len = 16\n', 'kind = "classification"\n').data, seed=0)
    b = cls.batch(0, 16)
    assert b.targets.dtype == torch.int64 and int(b.targets.max()) <= 5
    reg = make_source(_spec(d, 'kind = "jsonl"\npath = "d.jsonl"\nlabel_column = "score"\n'
                               'seq_len = 32\n', 'kind = "regression"\n').data, seed=0)
    assert reg.batch(0, 4).targets.dtype == torch.float32
    named = datafiles.sentences(20)
    for r in named:
        r["label"] = ["neg", "pos", "mixed"][int(r["label"]) % 3]
    datafiles.write_jsonl(tmp_path / "named.jsonl", named)
    arrays = load_arrays(_spec(tmp_path, 'kind = "jsonl"\npath = "named.jsonl"\nseq_len = 8\n',
                               'kind = "classification"\n').data)
    want = [["mixed", "neg", "pos"].index(str(r["label"])) for r in named]  # sorted names
    assert arrays["labels"].tolist() == want


def test_the_heldout_split_is_never_trained_on(d: Path) -> None:
    train, held = split_indices(200, 0.1)
    assert len(held) == 20 and not set(train) & set(held) and len(train) + len(held) == 200
    assert np.array_equal(split_indices(200, 0.1)[1], held)  # not the job's seed
    spec = _spec(d, 'kind = "jsonl"\npath = "d.jsonl"\ntokenizer = "tok.json"\nseq_len = 16\n'
                    'heldout = 0.25\n', 'kind = "masked_lm"\n')
    src = make_source(spec.data, seed=1)
    assert isinstance(src, TextRows)
    drawn = set()
    for step in range(40):
        rng = np.random.default_rng([1, step])
        drawn |= set(src.train_idx[rng.integers(0, src.train_idx.size, size=8)].tolist())
    assert not drawn & set(src.held_idx.tolist())
    held_batches = list(src.heldout_batches(8))
    assert sum(b.size for b in held_batches) == len(src.held_idx) == 30
    again = list(make_source(spec.data, seed=99).heldout_batches(8))  # any seed: the same
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(held_batches, again))
    tokens = np.arange(5000) % 200
    win = TextWindows(None, seq_len=16, seed=0, tokens=tokens, heldout=0.1)
    assert win.train_tokens == 4500
    for step in range(50):
        assert int(win.batch(step, 8).inputs.max()) < 200
        rng = np.random.default_rng([0, step])
        assert int(rng.integers(0, win.train_tokens - 17, size=8).max()) + 17 <= 4500
    assert sum(b.size for b in win.heldout_batches(10)) == 500 // 17


def test_an_image_folder_is_decoded_resized_and_augmented(d: Path) -> None:
    spec = _spec(d, 'kind = "image_folder"\npath = "img"\nimage_size = 12\nheldout = 0.2\n'
                    'augment = ["hflip", "crop"]\nmean = [0.5, 0.4, 0.3]\n', "")
    arrays = load_arrays(spec.data)
    assert arrays["pixel_values"].shape == (18, 3, 12, 12)
    assert arrays["pixel_values"].dtype == np.uint8
    assert arrays["labels"].tolist() == [0] * 6 + [1] * 6 + [2] * 6  # a class per directory
    src = make_source(spec.data, seed=4)
    assert isinstance(src, ImageArrays)
    b = src.batch(2, 6)
    assert b.inputs.shape == (6, 3, 12, 12) and b.inputs.dtype == torch.float32
    assert set(b.fields) == {"pixel_values", "labels"}
    assert torch.equal(src.batch(2, 6).inputs, b.inputs)  # transforms drawn from the step
    plain = make_source(replace(spec.data, augment=()), seed=4).batch(2, 6)
    assert torch.equal(plain.targets, b.targets) and not torch.equal(plain.inputs, b.inputs)
    px = torch.from_numpy(arrays["pixel_values"]).float() / 255
    held = next(iter(src.heldout_batches(64)))
    want = (px[src.held_idx] - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / 0.5
    torch.testing.assert_close(held.inputs, want)  # held-out images: no transforms


def _refused(spec: JobSpec, match: str) -> None:
    with pytest.raises(DataError, match=match):
        load_arrays(spec.data)


def test_bad_data_is_refused_naming_the_file_and_the_record(d: Path, tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "a b"}\n{"text": "c"\n')
    _refused(_spec(tmp_path, 'kind = "jsonl"\npath = "bad.jsonl"\n', 'kind = "masked_lm"\n'
                   'mask_token_id = 0\n'),
             r"bad\.jsonl:2: not valid JSON .* one object per line")
    (tmp_path / "list.jsonl").write_text('["a"]\n')
    _refused(_spec(tmp_path, 'kind = "jsonl"\npath = "list.jsonl"\n'),
             r"list\.jsonl:1: a list, not a JSON object")
    (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
    _refused(_spec(tmp_path, 'kind = "jsonl"\npath = "num.jsonl"\n'),
             r"num\.jsonl:1: column 'text' is int, not text")
    _refused(_spec(d, 'kind = "jsonl"\npath = "d.jsonl"\ncolumn = "body"\n'),
             r"has no column 'body' .*set data\.column")
    _refused(_spec(d, 'kind = "parquet"\npath = "d.parquet"\nlabel_column = "y"\n',
                   'kind = "classification"\n'), r"no column 'y' \(it has \[")
    _refused(_spec(d, 'kind = "hf_dataset"\npath = "ds"\nsplit = "validation"\n'),
             r"no split 'validation' \(it has \['train'\]\); set data\.split")
    _refused(_spec(d, 'kind = "jsonl"\npath = "d.jsonl"\nlabel_column = "summary"\n',
                   'kind = "regression"\n'),
             r"d\.jsonl:1: label 'the \w+ \w+' in column 'summary' is not a number")
    (tmp_path / "x.txt").write_text("not a dataset")
    _refused(_spec(tmp_path, 'kind = "hf_dataset"\npath = "."\n'),
             r"not a dataset saved with save_to_disk")
    one = tmp_path / "one"
    (one / "cat").mkdir(parents=True)
    _refused(_spec(tmp_path, 'kind = "image_folder"\npath = "one"\n'),
             r"1 class directories; .* at least 2")
    (one / "dog").mkdir()
    (one / "cat" / "a.png").write_bytes(b"not a png")
    _refused(_spec(tmp_path, 'kind = "image_folder"\npath = "one"\n'),
             r"class directory .*dog holds no images")
    (one / "dog" / "b.png").write_bytes(b"nor this")
    _refused(_spec(tmp_path, 'kind = "image_folder"\npath = "one"\n'),
             r"cat/a\.png: cannot decode the image .* remove it or convert it")
    _refused(_spec(d, 'kind = "image_folder"\npath = "img"\nmax_examples = 5\n'),
             r"18 images of 3x32x32 are more than 5")
    with pytest.raises(DataError, match=r"needs a mask token: .* set loss\.mask_token_id"):
        make_source(_spec(d, 'kind = "jsonl"\npath = "d.jsonl"\n', 'kind = "masked_lm"\n').data,
                    0)
    with pytest.raises(JobSpecError, match=r"data\.tokenizer: must be 'bytes', a tokenizers"):
        _spec(d, 'kind = "jsonl"\npath = "d.jsonl"\ntokenizer = "img"\n')


def test_shipped_arrays_are_checked() -> None:
    ok = {"tokens": np.zeros(10, np.uint8)}
    check_arrays(ok, "x")
    for bad, match in (({"weights": np.zeros(3, np.float32)}, "unknown data array 'weights'"),
                       ({"labels": np.zeros(3, np.float16)}, "float16"),
                       ({"input_ids": np.zeros((1,) * 5, np.int32)}, "5 dimensions")):
        with pytest.raises(DataError, match=match):
            check_arrays(bad, "the upload")


def test_an_assign_whose_partition_reads_a_field_the_data_lacks_is_refused(d: Path) -> None:
    from fusiond.train.remote import StageAssignment, _fields_of, _stage_data

    spec = _spec(d, 'kind = "jsonl"\npath = "d.jsonl"\ntokenizer = "tok.json"\nseq_len = 16\n',
                 'kind = "masked_lm"\n')
    arrays = load_arrays(spec.data)
    sa = StageAssignment.__new__(StageAssignment)
    for k, v in dict(job_id="j", stage=0, data=spec.data, data_arrays=dict(arrays), seed=0,
                     data_digest=dataset_digest(arrays), first_step=0).items():
        object.__setattr__(sa, k, v)
    assert set(_fields_of(_stage_data(sa), sa)) == {"input_ids", "attention_mask", "labels"}
    object.__setattr__(sa, "data_digest", "0" * 32)
    with pytest.raises(RemoteError, match="is not the submitter's"):
        _stage_data(sa)
    object.__setattr__(sa, "data_arrays", {"tokens": np.zeros(3, np.uint8)})
    with pytest.raises(RemoteError, match="its data: row data needs input_ids"):
        _stage_data(sa)


def test_an_assigns_data_config_is_checked_naming_the_field() -> None:
    from fusiond.train.remote import _data_spec
    from protocol.messages import DataConfig

    ok = DataConfig(kind="jsonl", tokenizer="bytes", seq_len=16, image_size=32, channels=3,
                    num_classes=10, objective="masked_lm", layout="rows", heldout=0.1)
    assert _data_spec(ok, None).objective == "masked_lm"
    for field, value, match in (("kind", "audio", "kind"), ("objective", "gan", "objective"),
                                ("layout", "pages", "layout"), ("heldout", 0.9, "heldout"),
                                ("mask_probability", 0.0, "mask_probability"),
                                ("augment", ("rotate",), "augment"), ("std", (0.0,), "std"),
                                ("mask_token_id", -3, "mask_token_id"),
                                ("seq_len", 0, "seq_len")):
        with pytest.raises(RemoteError, match=rf"Assign\.config\.data\.{match}: "):
            _data_spec(replace(ok, **{field: value}), None)
