"""Submit-side refusals: each bad job is refused before anything starts, naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fusiond.errors import FusionError
from fusiond.graph import CaptureError
from fusiond.jobs.submit import (
    CapacityError,
    check_capacity,
    memory_estimate,
    prepare_job,
    restore_job,
    resume_state,
)
from fusiond.models.gpt2 import gpt2
from fusiond.train.data import DataError
from fusiond.train.sample import sample_bytes
from fusiond.train.spec import JobSpecError

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 8)
        self.out = nn.Linear(8, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        if h.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
            h = h * 2
        return self.out(h)


def data_dependent() -> nn.Module:
    return _DataDependent()


def broken(**_: object) -> nn.Module:
    raise RuntimeError("factory exploded")


def not_a_module() -> int:
    return 3


def _job(tmp_path: Path, model: str, data: str = "") -> Path:
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    p = tmp_path / "job.toml"
    p.write_text(f"[job]\nsteps = 2\n[model]\n{model}\n[data]\nseq_len = 16\n"
                 f"path = \"{data or 'corpus.txt'}\"\n[batch]\nsize = 4\nmicro_batches = 2\n")
    return p


@pytest.mark.parametrize(("model", "data", "err", "match"), [
    ('zoo = "alexnet"', "", JobSpecError, "model.zoo: unknown model 'alexnet'"),
    ('factory = "no_such_pkg.models:build"', "", JobSpecError, "model.factory: cannot import"),
    ('factory = "tests.train.test_submit:missing"', "", JobSpecError, "no callable 'missing'"),
    ('factory = "tests.train.test_submit:broken"', "", JobSpecError, "factory exploded"),
    ('factory = "tests.train.test_submit:not_a_module"', "", JobSpecError, "not nn.Module"),
    ('zoo = "gpt2"', "nowhere/at/all", JobSpecError, "data.path: no such file"),
])
def test_bad_jobs_are_refused_naming_the_problem(
    tmp_path: Path, model: str, data: str, err: type[Exception], match: str
) -> None:
    with pytest.raises(err, match=match) as ei:
        prepare_job(_job(tmp_path, model, data))
    assert isinstance(ei.value, FusionError)


def test_too_short_data_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("abc")
    p = _job(tmp_path, 'zoo = "gpt2"\nconfig = { size = "tiny" }', "tiny.txt")
    with pytest.raises(DataError, match="needs more than"):
        prepare_job(p)


def test_uncapturable_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="_DataDependent"):
        prepare_job(_job(tmp_path, 'factory = "tests.train.test_submit:data_dependent"'))


@pytest.mark.slow
def test_prepare_and_capacity(tmp_path: Path) -> None:
    job = prepare_job(_job(tmp_path, 'zoo = "gpt2"\nconfig = { size = "tiny" }'))
    assert job.graph_bytes and job.state_bytes and job.tokens_per_sample == 16
    spec, cap = restore_job(job.toml_text, job.base, job.out_base, job.graph_bytes,
                            job.state_bytes)
    assert spec == job.spec and cap.graph == job.captured.graph
    assert all(torch.equal(cap.state[k], v) for k, v in job.captured.state.items())
    need = memory_estimate(job.captured, job.spec)
    n_params = sum(p.numel() for p in gpt2("tiny").parameters())  # tied weight once
    assert need >= 4 * n_params * 4  # params + grads + two AdamW moments, fp32
    check_capacity(job.captured, job.spec, {"a": need, "b": 1})
    with pytest.raises(CapacityError, match="GiB"):
        check_capacity(job.captured, job.spec, {"a": need // 3, "b": need // 3})


def test_sample_bytes_is_seeded_text() -> None:
    torch.manual_seed(0)
    m = gpt2("tiny")
    a = sample_bytes(m, "def ", length=20, seed=1)
    b = sample_bytes(m, "def ", length=20, seed=1)
    assert a == b and a.startswith("def ") and len(a.encode("utf-8", "replace")) >= 20
    assert m.training  # mode restored


def test_resume_state_checks_the_file_against_the_model(tmp_path: Path) -> None:
    from fusiond.errors import LocalError
    from fusiond.jobs.coordinator import save_checkpoint
    from fusiond.jobs.results import save_model

    job = prepare_job(_job(tmp_path, 'zoo = "gpt2"\nconfig = { size = "tiny" }'))
    cap = job.captured
    trained = {k: v + 1.0 if v.is_floating_point() else v for k, v in cap.state.items()}
    ckpt = save_checkpoint(tmp_path, 4, trained)
    assert ckpt.name == "checkpoint-5.safetensors"
    state, first = resume_state(cap, ckpt)
    assert first == 5
    assert all(torch.equal(state[k], trained[k]) for k in cap.state)
    # a finished model: its weights, a new run from step 0
    state, first = resume_state(cap, save_model(tmp_path / "model.safetensors", trained))
    assert first == 0 and all(torch.equal(state[k], trained[k]) for k in cap.state)
    name = next(k for k, v in cap.state.items() if v.dim() == 2)
    cases = {
        "missing": ({k: v for k, v in trained.items() if k != name}, f"lacks '{name}'"),
        "unknown": ({**trained, "extra.weight": torch.zeros(1)}, "'extra.weight' is not in"),
        "shape": ({**trained, name: torch.zeros(3, 3)}, "this job's model has"),
        "dtype": ({**trained, name: trained[name].double()}, "float64"),
        # a diverged run's checkpoint: NaN (or Inf) trains to NaN and crashed the scheduler
        "nan": ({**trained, name: trained[name].clone().index_fill_(0, torch.tensor([0]),
                                                                 float("nan"))},
                f"tensor '{name}' holds {trained[name].shape[1]} non-finite values"),
        "inf": ({**trained, name: trained[name].clone().fill_(float("inf"))}, "0 NaN"),
    }
    for case, (bad, match) in cases.items():
        path = save_model(tmp_path / f"{case}.safetensors", bad, metadata={"step": "1"})
        with pytest.raises(LocalError, match=match):
            resume_state(cap, path)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LocalError, match="cannot read"):
        resume_state(cap, tmp_path / "junk.safetensors")
    with pytest.raises(LocalError, match="cannot read"):
        resume_state(cap, tmp_path / "absent.safetensors")
    path = save_model(tmp_path / "badstep.safetensors", trained, metadata={"step": "x"})
    with pytest.raises(LocalError, match="not an integer"):
        resume_state(cap, path)


TEXT_JOB = """
[job]
steps = 2
[model]
zoo = "gpt2"
config = {config}
[data]
path = "corpus.txt"
seq_len = {seq_len}
[batch]
size = 4
micro_batches = 2
"""


@pytest.mark.parametrize(("config", "seq_len", "match"), [
    # the corpus's bytes reach 126 ("~"): a vocabulary of 100 cannot embed them
    ('{ size = "tiny", vocab_size = 100 }', 16,
     r"the data has token id 126 \(data.tokenizer = 'bytes'\) but the model's embedding "
     r"'transformer.wte' holds 100 tokens \(ids 0..99\): give the model a vocabulary of at "
     r"least 127"),
    ('{ size = "tiny" }', 128,
     r"data.seq_len = 128 is longer than the model's context: its embedding 'transformer.wpe' "
     r"holds 64 positions; set data.seq_len <= 64"),
])
def test_data_the_model_cannot_take_is_refused_at_submit(
        tmp_path: Path, config: str, seq_len: int, match: str) -> None:
    """Both used to pass submit and fail at step 0 on every stage machine, which were then
    excluded as if broken: one micro-batch of the job's own data through the model here finds
    it first, naming both numbers."""
    from fusiond.jobs.submit import DataFitError

    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1  # ~\n" * 200)
    p = tmp_path / "job.toml"
    p.write_text(TEXT_JOB.format(config=config, seq_len=seq_len))
    with pytest.raises(DataFitError, match=match):
        prepare_job(p)


@pytest.mark.slow
def test_labels_past_the_models_classes_are_refused_at_submit(tmp_path: Path) -> None:
    from fusiond.jobs.submit import DataFitError

    p = tmp_path / "job.toml"
    p.write_text('[job]\nsteps = 2\n[model]\nzoo = "resnet18"\n'
                 "config = { num_classes = 10, width = 8 }\n[data]\nkind = \"images\"\n"
                 'image_size = 16\nnum_classes = 40\n[loss]\nkind = "cross_entropy"\n'
                 "[batch]\nsize = 8\nmicro_batches = 1\n")
    with pytest.raises(DataFitError, match=r"the data's label \d+ is past what the model "
                                           r"predicts: data.num_classes = 40 while the model "
                                           r"outputs 10 classes"):
        prepare_job(p)


def test_the_check_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    """The dry forward runs in eval mode without gradients: the weights and buffers (and the
    captured state the job ships) are unchanged, and the model is back in training mode."""
    from fusiond.jobs.submit import check_data_fits
    from fusiond.train.data import make_source
    from fusiond.train.spec import load_job

    spec = load_job(_job(tmp_path, 'zoo = "gpt2"\nconfig = { size = "tiny" }'))
    model = gpt2("tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    check_data_fits(spec, model, make_source(spec.data, spec.seed))
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_tied_copies_that_are_both_nan_gather() -> None:
    """A diverged run's tied weight is NaN on both stages, bit for bit: gathering it must not
    take NaN != NaN for copies that differ (that crashed the scheduler, leaving the job
    "running" on its submitter); copies that really differ still do."""
    from fusiond.errors import LocalError
    from fusiond.jobs.results import gather_state
    from fusiond.train.programs import capture_job
    from fusiond.train.spec import default_text_path, parse_job

    spec = parse_job(TEXT_JOB.format(config='{ size = "tiny" }', seq_len=16).replace(
        "corpus.txt", "json"), base=default_text_path())
    _, cap = capture_job(spec)
    tied = next(iter(cap.graph.aliases.values()))
    nan = cap.state[tied].clone().fill_(float("nan"))
    a = {**cap.state, tied: nan}
    b = {tied: nan.clone()}
    out = gather_state(cap.graph, [a, b])
    assert torch.isnan(out[tied]).all()
    with pytest.raises(LocalError, match="differ between stages"):
        gather_state(cap.graph, [a, {tied: torch.zeros_like(nan)}])


def test_a_model_that_does_not_fit_its_objective_is_refused_with_the_reason(
        tmp_path: Path) -> None:
    """A bidirectional encoder on next-token prediction sees the token it must predict; an
    encoder-decoder on an objective that gives its decoder no inputs fails inside
    transformers: both are refused at submit saying why and what to use."""
    from fusiond.jobs.submit import ObjectiveError
    from tests import datafiles

    recs = datafiles.sentences(40)
    datafiles.write_jsonl(tmp_path / "d.jsonl", recs)
    datafiles.train_tokenizer(recs, tmp_path / "tok.json")
    head = ('[job]\nsteps = 2\n[batch]\nsize = 4\nmicro_batches = 2\n[data]\nkind = "jsonl"\n'
            'path = "d.jsonl"\ntokenizer = "tok.json"\nseq_len = 16\n')
    bert = tmp_path / "bert.toml"
    bert.write_text(head + datafiles.hf_model_toml("BertForMaskedLM", "bert"))
    with pytest.raises(ObjectiveError, match=r"loss\.kind = 'causal_lm' predicts each next "
                       r"token, but BertForMaskedLM is not causal: .* train it with loss\.kind "
                       r"= 'masked_lm'"):
        prepare_job(bert)
    t5 = tmp_path / "t5.toml"
    t5.write_text(head + '[loss]\nkind = "masked_lm"\n'
                  + datafiles.hf_model_toml("T5ForConditionalGeneration", "t5"))
    with pytest.raises(JobSpecError, match=r"T5ForConditionalGeneration is an encoder-decoder "
                       r".* loss\.kind = 'seq2seq_lm' and a data\.target_column"):
        prepare_job(t5)
    # a causal decoder on masked LM never sees the right-hand context it is scored on
    llama = tmp_path / "llama.toml"
    llama.write_text(head + '[loss]\nkind = "masked_lm"\nmask_token_id = 3\n'
                     + datafiles.hf_model_toml("LlamaForCausalLM", "llama"))
    with pytest.raises(ObjectiveError, match=r"loss\.kind = 'masked_lm' predicts each masked "
                       r"token from the tokens on both sides, but LlamaForCausalLM is causal.* "
                       r"train it with loss\.kind = 'causal_lm'"):
        prepare_job(llama)
    # per-token logits on a per-sample objective, and a head of the wrong width on regression:
    # refused by shape, not with torch's error from inside the loss
    lm_head = tmp_path / "lm-classify.toml"
    lm_head.write_text(head + '[loss]\nkind = "classification"\n'
                       + datafiles.hf_model_toml("BertForMaskedLM", "bert"))
    with pytest.raises(ObjectiveError, match=r"loss\.kind = 'classification' scores one "
                       r"prediction per sample .* logits for every token \(a language-model "
                       r"head\); use loss\.kind = 'causal_lm' or 'masked_lm'"):
        prepare_job(lm_head)
    wide = tmp_path / "regress.toml"
    wide.write_text(head + '[loss]\nkind = "regression"\n'
                    + datafiles.hf_model_toml("BertForSequenceClassification", "bert",
                                              num_labels=4))
    with pytest.raises(ObjectiveError, match=r"loss\.kind = 'regression' compares "
                       r"BertForSequenceClassification's output \(2, 4\) with the labels "
                       r"\(2,\) .* num_labels = 1"):
        prepare_job(wide)
