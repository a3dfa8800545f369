"""Job spec: examples load, defaults are sane, every bad field is named."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fusiond.errors import LocalError
from fusiond.train.spec import (
    JobSpecError,
    default_text_path,
    job_from_dict,
    load_job,
    parse_job,
)

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))

MINIMAL = """
[job]
steps = 10
[model]
zoo = "gpt2"
config = { size = "tiny" }
"""


def test_examples_load() -> None:
    assert len(EXAMPLES) >= 3
    for p in EXAMPLES:
        spec = load_job(p)
        assert spec.steps > 0
        assert spec.batch.size % spec.batch.micro_batches == 0


def test_defaults() -> None:
    spec = parse_job(MINIMAL, base=Path("/tmp"), out_base=Path("/tmp"))
    assert spec.model.target == "fusiond.models.gpt2:gpt2"
    assert spec.data.kind == "text" and spec.data.path == default_text_path()
    assert spec.data.tokenizer == "bytes"
    assert spec.optimizer.kind == "adamw" and spec.optimizer.schedule == "constant"
    assert spec.batch.pipeline == "1f1b" and not spec.batch.replicas
    assert spec.batch.micro_batch_size * spec.batch.micro_batches == spec.batch.size
    assert spec.output == Path("/tmp/runs/job")
    assert spec.compression.density is None and spec.compression.exact_edges == ()
    assert spec.compression.readapt_interval_s == 10.0
    # the per-link codec choice, at a 1 % accuracy budget, is the default
    c = spec.compression
    assert c.codec == "auto" and c.choice and c.compress and not c.int8
    assert not c.adatopk and c.edge_encoding == "raw"
    assert c.accuracy_budget == 0.01
    # one density floor, the planner's
    from fusiond.plan.model import DEFAULT_DENSITY_FLOOR, JobSettings

    assert c.density_floor == DEFAULT_DENSITY_FLOOR == JobSettings().density_floor


def test_the_codec_choice_and_its_budget() -> None:
    c = parse_job(MINIMAL + "[compression]\naccuracy_budget = 0.02\n").compression
    assert c.choice and c.accuracy_budget == 0.02
    for codec in ("bf16", "int8", "int4", "lowrank"):
        q = parse_job(MINIMAL + f'[compression]\ncodec = "{codec}"\n').compression
        assert q.edge_encoding == codec and not q.compress and not q.choice
    # adatopk or a density said: top-k, as before
    t = parse_job(MINIMAL + "[compression]\nadatopk = true\n").compression
    assert t.codec == "topk" and t.adatopk and t.compress
    with pytest.raises(JobSpecError, match=r"compression\.accuracy_budget.*'auto' only"):
        parse_job(MINIMAL + '[compression]\ncodec = "int8"\naccuracy_budget = 0.02\n')
    with pytest.raises(JobSpecError, match=r"compression\.accuracy_budget"):
        parse_job(MINIMAL + "[compression]\naccuracy_budget = 0.9\n")
    with pytest.raises(JobSpecError, match=r"compression\.codec"):
        parse_job(MINIMAL + '[compression]\ncodec = "fp8"\n')


def test_batch_replicas_lets_the_planner_replicate_stages() -> None:
    spec = parse_job(MINIMAL + "[batch]\nreplicas = true\n")
    assert spec.batch.replicas
    with pytest.raises(JobSpecError, match=r"batch\.replicas"):
        parse_job(MINIMAL + '[batch]\nreplicas = "yes"\n')


def test_int8_codec_replaces_topk_on_every_cut_edge() -> None:
    spec = parse_job(MINIMAL + '[compression]\ncodec = "int8"\nexact_edges = ["x:0"]\n')
    c = spec.compression
    assert c.codec == "int8" and c.int8
    assert not c.adatopk and c.density is None  # no top-k on top of int8
    assert c.exact_edges == ("x:0",)
    # saying adatopk = false too is allowed (it is what int8 means)
    again = parse_job(MINIMAL + '[compression]\ncodec = "int8"\nadatopk = false\n')
    assert again.compression == replace(c, exact_edges=())
    # old job files (no codec) keep their meaning
    old = parse_job(MINIMAL + "[compression]\nadatopk = false\ndensity = 0.1\n")
    assert old.compression.codec == "topk" and old.compression.density == 0.1


def test_a_bad_codec_names_the_allowed_values() -> None:
    with pytest.raises(JobSpecError) as ei:
        parse_job(MINIMAL + '[compression]\ncodec = "int2"\n')
    assert ei.value.field == "compression.codec"
    for name in ("auto", "topk", "bf16", "int8", "int4", "lowrank"):
        assert f"'{name}'" in str(ei.value)
    with pytest.raises(JobSpecError, match=r"compression\.density: top-k does not apply with "
                                           r"compression\.codec = 'int8'"):
        parse_job(MINIMAL + '[compression]\ncodec = "int8"\ndensity = 0.5\n')


def _doc(**tables: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {"job": {"steps": 10}, "model": {"zoo": "gpt2"}}
    for k, v in tables.items():
        doc[k] = {**doc.get(k, {}), **v}
    return doc


BAD: list[tuple[dict[str, Any], str]] = [
    ({"model": {"zoo": "gpt2"}}, "job"),
    (_doc(job={"steps": 0}), "job.steps"),
    (_doc(job={"steps": "ten"}), "job.steps"),
    (_doc(job={"name": "has space"}), "job.name"),
    (_doc(job={"checkpoint_interval": -1}), "job.checkpoint_interval"),
    (_doc(job={"stpes": 3}), "job.stpes"),
    (_doc(model={"zoo": "alexnet"}), "model.zoo"),
    ({"job": {"steps": 1}, "model": {}}, "model.zoo"),
    (_doc(model={"factory": "x:y"}), "model.zoo"),
    ({"job": {"steps": 1}, "model": {"factory": "not a path"}}, "model.factory"),
    (_doc(model={"config": {"size": {"nested": 1}}}), "model.config.size"),
    (_doc(data={"kind": "audio"}), "data.kind"),
    (_doc(data={"path": "/definitely/not/here"}), "data.path"),
    (_doc(data={"tokenizer": "missing.json"}), "data.tokenizer"),
    (_doc(data={"seq_len": 0}), "data.seq_len"),
    (_doc(data={"kind": "images", "path": "x"}), "data.path"),
    (_doc(data={"kind": "images"}, loss={"kind": "causal_lm"}), "loss.kind"),
    (_doc(data={"kind": "images"}, loss={"kind": "lm_cross_entropy"}), "loss.kind"),
    (_doc(data={"kind": "jsonl"}), "data.path"),
    (_doc(data={"kind": "image_folder"}), "data.path"),
    (_doc(data={"kind": "text"}, loss={"kind": "classification"}), "loss.kind"),
    (_doc(data={"layout": "windows"}, loss={"kind": "seq2seq_lm"}), "data.layout"),
    (_doc(data={"layout": "pages"}), "data.layout"),
    (_doc(data={"heldout": 0.9}), "data.heldout"),
    (_doc(data={"augment": ["hflip"]}), "data.augment"),
    (_doc(data={"kind": "images", "augment": ["rotate"]}), "data.augment"),
    (_doc(data={"kind": "image_folder", "path": ".", "mean": [0.5]}), "data.mean"),
    (_doc(data={"kind": "image_folder", "path": ".", "std": [0.5, 0.0, 0.5]}), "data.std"),
    (_doc(loss={"kind": "masked_lm", "mask_probability": 0}), "loss.mask_probability"),
    (_doc(loss={"kind": "causal_lm", "mask_token_id": 3}), "loss.mask_token_id"),
    (_doc(loss={"kind": "causal_lm", "ignore_index": "x"}), "loss.ignore_index"),
    (_doc(model={"inputs": []}), "model.inputs"),
    (_doc(model={"inputs": ["input ids"]}), "model.inputs"),
    (_doc(loss={"kind": "hinge"}), "loss.kind"),
    (_doc(optimizer={"kind": "lion"}), "optimizer.kind"),
    (_doc(optimizer={"lr": -1.0}), "optimizer.lr"),
    (_doc(optimizer={"lr": 0}), "optimizer.lr"),
    (_doc(optimizer={"lr": float("nan")}), "optimizer.lr"),
    (_doc(optimizer={"betas": [0.9]}), "optimizer.betas"),
    (_doc(optimizer={"betas": [0.9, 1.5]}), "optimizer.betas"),
    (_doc(optimizer={"weight_decay": -0.1}), "optimizer.weight_decay"),
    (_doc(optimizer={"schedule": "step"}), "optimizer.schedule"),
    (_doc(optimizer={"warmup_steps": 11}), "optimizer.warmup_steps"),
    (_doc(optimizer={"lr": 1e-3, "min_lr": 1e-2}), "optimizer.min_lr"),
    (_doc(batch={"size": 8, "micro_batches": 3}), "batch.micro_batches"),
    (_doc(batch={"size": 8, "micro_batch_size": 3}), "batch.micro_batch_size"),
    (_doc(batch={"size": 8, "micro_batch_size": 2, "micro_batches": 4}), "batch.micro_batches"),
    (_doc(batch={"size": 0}), "batch.size"),
    (_doc(batch={"pipeline": "zb"}), "batch.pipeline"),
    (_doc(compression={"density": 0.0}), "compression.density"),
    (_doc(compression={"density": 0.01, "density_floor": 0.05}), "compression.density"),
    (_doc(compression={"density_floor": 2}), "compression.density_floor"),
    (_doc(compression={"adatopk": "yes"}), "compression.adatopk"),
    (_doc(compression={"exact_edges": "e1"}), "compression.exact_edges"),
    (_doc(compression={"readapt_interval_s": -1}), "compression.readapt_interval_s"),
    (_doc(compression={"codec": "fp4"}), "compression.codec"),
    (_doc(compression={"codec": 8}), "compression.codec"),
    (_doc(compression={"codec": ""}), "compression.codec"),
    (_doc(compression={"codec": "int8", "adatopk": True}), "compression.adatopk"),
    (_doc(compression={"codec": "int8", "density": 0.1}), "compression.density"),
    (_doc(compression={"codec": "int8", "adatopk": "no"}), "compression.adatopk"),
    (_doc(extra={"x": 1}), "extra"),
    ({"job": {"steps": 1}, "model": {"zoo": "gpt2"}, "optimizer": []}, "optimizer"),
]


@pytest.mark.parametrize(("doc", "field"), BAD, ids=[f for _, f in BAD])
def test_bad_field_is_named(doc: dict[str, Any], field: str, tmp_path: Path) -> None:
    with pytest.raises(JobSpecError) as ei:
        job_from_dict(doc, base=tmp_path)
    assert ei.value.field == field
    assert str(ei.value).startswith(field + ":")
    assert isinstance(ei.value, LocalError)


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match="not valid TOML"):
        parse_job("[job\nsteps=1")
    with pytest.raises(JobSpecError, match="cannot read job file"):
        load_job(tmp_path / "nope.toml")


def test_relative_paths_resolve_against_the_job_file(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text("hello world " * 100)
    job = tmp_path / "job.toml"
    job.write_text(MINIMAL + '[data]\npath = "corpus.txt"\n')
    spec = load_job(job)
    assert spec.data.path == tmp_path / "corpus.txt"
    assert spec.output == Path.cwd() / "runs" / "job"  # results land where the user is
