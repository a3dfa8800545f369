"""Inputs by name (issue 20): Hugging Face models take their batch by keyword (input_ids,
attention_mask, decoder_input_ids, pixel_values), with no adapter, from data on disk (text
rows, a saved dataset, an image folder); cut in 3 they train exactly as eager (losses to 1e-5,
weights to 1e-5), and the gathered weights load strictly into the original HF class."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusiond.graph import contiguous_assignment, partition
from fusiond.jobs.results import gather_state
from fusiond.train.data import make_source
from fusiond.train.local import ReferenceTrainer, run_pipeline
from fusiond.train.model import build_model, feed_for, loss_fn
from fusiond.train.programs import capture_job_feed, stage_programs
from fusiond.train.spec import JobSpec, parse_job
from tests import datafiles

pytestmark = [pytest.mark.slow, pytest.mark.compute_only]

HEAD = """
[job]
name = "{name}"
steps = 3
seed = 5
[optimizer]
lr = 3e-3
[batch]
size = 4
micro_batches = 2
"""

M = datafiles.hf_model_toml

JOBS = {
    # masked LM over rows: attention masks on padded rows, labels -100 but at masked tokens
    "bert-mlm": M("BertForMaskedLM", "bert") + """
[data]
kind = "jsonl"
path = "d.jsonl"
tokenizer = "tok.json"
seq_len = 16
[loss]
kind = "masked_lm"
""",
    # next-token prediction over padded rows: the mask and -100 at the pads
    "llama-rows": M("LlamaForCausalLM", "llama") + """
[data]
kind = "parquet"
path = "d.parquet"
tokenizer = "toktf"
seq_len = 16
layout = "rows"
""",
    # encoder-decoder: input_ids + attention_mask + decoder_input_ids, seq2seq labels
    "t5": M("T5ForConditionalGeneration", "t5") + """
[data]
kind = "hf_dataset"
path = "ds"
tokenizer = "tok.json"
seq_len = 16
target_column = "summary"
target_len = 8
[loss]
kind = "seq2seq_lm"
""",
    # sentence pairs: token_type_ids too; classification
    "bert-pairs": M("BertForSequenceClassification", "bert", num_labels=6) + """
[data]
kind = "jsonl"
path = "d.jsonl"
tokenizer = "tok.json"
pair_column = "summary"
seq_len = 24
[loss]
kind = "classification"
""",
    # images by name: pixel_values from a class-per-directory folder, with seeded augments
    "vit-folder": M("ViTForImageClassification", "vit", num_labels=3) + """
[data]
kind = "image_folder"
path = "img"
image_size = 16
augment = ["hflip", "crop"]
""",
}

INPUTS = {
    "bert-mlm": ["input_ids", "attention_mask", "labels"],
    "llama-rows": ["input_ids", "attention_mask", "labels"],
    "t5": ["input_ids", "attention_mask", "decoder_input_ids", "labels"],
    "bert-pairs": ["input_ids", "attention_mask", "token_type_ids", "labels"],
    "vit-folder": ["pixel_values", "labels"],
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("named")
    recs = datafiles.sentences(160)
    datafiles.write_jsonl(d / "d.jsonl", recs)
    datafiles.write_parquet(d / "d.parquet", recs)
    datafiles.save_dataset(d / "ds", recs)
    datafiles.train_tokenizer(recs, d / "tok.json")
    datafiles.transformers_tokenizer(d / "tok.json", d / "toktf")
    datafiles.image_folder(d / "img", classes=3, per_class=6)
    return d


def _spec(name: str, base: Path) -> JobSpec:
    return parse_job(HEAD.format(name=name) + JOBS[name], base=base)


@pytest.mark.parametrize("name", sorted(JOBS))
async def test_named_inputs_cut_in_three_match_eager(name: str, data_dir: Path) -> None:
    spec = _spec(name, data_dir)
    source = make_source(spec.data, spec.seed)
    model, cap, feed = capture_job_feed(spec, source)
    assert [i.name for i in cap.graph.inputs] == INPUTS[name]
    assert feed.by_keyword
    batch = source.batch(0, 4)
    if "attention_mask" in batch.fields:  # padded rows: the mask is not all ones
        assert int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()
    if spec.loss.kind in ("masked_lm", "causal_lm", "seq2seq_lm"):
        assert bool((batch.targets == -100).any())  # ignore_index where nothing is learnt
    parts = partition(cap.graph, contiguous_assignment(cap.graph, 3))
    progs = stage_programs(cap.graph, parts, cap.state)
    res = await run_pipeline(progs, data=source, batch_size=spec.batch.size,
                             micro_batches=spec.batch.micro_batches, optimizer=spec.optimizer,
                             steps=spec.steps)
    ref_model = build_model(spec.model, seed=spec.seed)
    rt = ReferenceTrainer(ref_model, loss_fn(spec.loss), spec.optimizer, data=source,
                          batch_size=spec.batch.size, micro_batches=spec.batch.micro_batches,
                          total_steps=spec.steps, feed=feed_for(ref_model, batch, spec))
    want = rt.train(0, spec.steps)
    for got, exp in zip(res.losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-5)
    state = gather_state(cap.graph, res.states.values())
    cls = type(model)
    fresh = cls(model.config)  # the original HF class: no adapter, no prefix
    fresh.load_state_dict(state, strict=True)
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v, rtol=1e-5, atol=1e-5, msg=k)
