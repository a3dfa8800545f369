"""Shared fixtures: a small text corpus (one stdlib package) so tests load data fast."""

from __future__ import annotations

import pytest

from fusiond.train.data import TextWindows
from fusiond.train.spec import OptimizerSpec, default_text_path


@pytest.fixture(scope="session")
def small_text() -> TextWindows:
    """Byte-level windows of 32 tokens over the stdlib's `json` package."""
    return TextWindows(default_text_path() / "json", seq_len=32, seed=1)


@pytest.fixture
def adamw() -> OptimizerSpec:
    """AdamW with weight decay and a warmed-up cosine schedule (exercises every LR path)."""
    return OptimizerSpec(
        kind="adamw", lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, momentum=0.0,
        schedule="cosine", warmup_steps=3, min_lr=1e-4,
    )


CAPTURED_JOB = """
[job]
name = "tiny"
steps = 20
seed = 3
[model]
zoo = "gpt2"
config = { size = "tiny" }
[data]
path = "json"
seq_len = 32
[optimizer]
lr = 1e-3
weight_decay = 0.1
schedule = "cosine"
warmup_steps = 3
[batch]
size = 8
micro_batches = 4
"""


@pytest.fixture(scope="session")
def captured_tiny():  # type: ignore[no-untyped-def]
    """(spec, CapturedModel) of GPT-2 tiny with its loss, captured once per session (~10 s)."""
    from fusiond.train.programs import capture_job
    from fusiond.train.spec import parse_job

    spec = parse_job(CAPTURED_JOB, base=default_text_path())
    _, captured = capture_job(spec)
    return spec, captured
