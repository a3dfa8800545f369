"""AssignConfig: the job settings of an Assign are one schema; a mistyped or oversized field
is refused on decode with an error naming its path."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import RemoteProtocolError
from protocol.frames import FrameDecoder
from protocol.messages import (
    MAX_ASSIGN_STAGES,
    Assign,
    AssignConfig,
    DataConfig,
    OptimizerConfig,
    decode_message,
    encode_message,
)

OPT = OptimizerConfig(kind="adamw", lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8,
                      momentum=0.0, schedule="cosine", warmup_steps=10, min_lr=0.0)
DATA = DataConfig(kind="text", tokenizer="bytes", seq_len=64, image_size=0, channels=0,
                  num_classes=0, path="/tmp/corpus", digest="ab" * 32)
CFG = AssignConfig(version=1, steps=100, seed=7, batch_size=8, micro_batches=4,
                   pipeline="1f1b", optimizer=OPT, data=DATA, input_name="x",
                   loss_name="loss", stage_nodes={"0": "a", "1": "b"},
                   shared={"0": {"wte": (1,)}}, first_step=3, recv_timeout_s=30.0)


def _roundtrip(msg: Assign) -> Assign:
    wire = b"".join(bytes(x) for x in encode_message(msg))
    [frame] = FrameDecoder().feed(wire)
    got = decode_message(frame)
    assert isinstance(got, Assign)
    return got


def _assign(config: Any) -> Assign:
    return Assign(1, 1, "j", 1, 0, b"ir", nodes={"a": ("h", 1), "b": ("h", 2)}, config=config)


@settings(max_examples=60, deadline=None)
@given(steps=st.integers(1, 1 << 40), lr=st.floats(0, 10, allow_nan=False),
       timeout=st.none() | st.floats(1, 3600), targets=st.none() | st.text(max_size=8),
       shared=st.dictionaries(st.text("0123456789", min_size=1, max_size=3),
                              st.dictionaries(st.text(max_size=6),
                                              st.lists(st.integers(0, 99), max_size=3)
                                              .map(tuple), max_size=2), max_size=3))
def test_the_config_round_trips(steps: int, lr: float, timeout: float | None,
                                targets: str | None,
                                shared: dict[str, dict[str, tuple[int, ...]]]) -> None:
    cfg = dataclasses.replace(CFG, steps=steps, optimizer=dataclasses.replace(OPT, lr=lr),
                              recv_timeout_s=timeout, targets_name=targets, shared=shared)
    assert _roundtrip(_assign(cfg)).config == cfg


def test_the_memory_plan_round_trips_and_is_typed() -> None:
    cfg = dataclasses.replace(CFG, checkpoint_blocks={"0": (1, 3), "1": (0,)},
                              offload_param_slots=(1,))
    assert _roundtrip(_assign(cfg)).config == cfg
    bad = _assign(cfg).to_wire()
    bad["config"]["checkpoint_blocks"] = {"0": ["one"]}
    with pytest.raises(RemoteProtocolError, match=r"checkpoint_blocks\['0'\]\[0\]: expected int"):
        Assign.from_wire(bad)


def test_the_wire_keys_are_those_of_the_old_hand_checked_map() -> None:
    wire = CFG.to_wire()
    assert wire["optimizer"]["betas"] == [0.9, 0.999] and wire["data"]["path"] == "/tmp/corpus"
    assert {"version", "steps", "first_step", "seed", "checkpoint_interval", "batch_size",
            "micro_batches", "pipeline", "per_row", "optimizer", "data", "input_name",
            "targets_name", "loss_name", "stage_nodes", "shared", "recv_timeout_s",
            "slot_stages", "routes", "grad_rank", "grad_warmup_steps", "eval_interval", "precision",
            "recompute_slots", "offload_slots", "checkpoint_blocks",
            "offload_param_slots", "slot_devices", "grad_buckets", "in_flight",
            "grad_groups", "grad_two_level", "micro_batch_sizes"} == set(wire)
    # the last four came with replicas and their low-rank reduction: an older reader ignores
    # unknown keys; a job without replicas leaves them empty, grad_rank None


def _bad(path: list[str], value: Any) -> dict[str, Any]:
    header = _assign(CFG).to_wire()
    d = header["config"]
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return header


@pytest.mark.parametrize(("path", "value", "expected"), [
    (["steps"], "100", r"Assign\.config\.steps: expected int, got str"),
    (["optimizer", "lr"], "fast", r"Assign\.config\.optimizer\.lr: expected float, got str"),
    (["optimizer", "betas"], [0.9], r"Assign\.config\.optimizer\.betas: expected 2 items"),
    (["data", "seq_len"], True, r"Assign\.config\.data\.seq_len: expected int, got bool"),
    (["stage_nodes"], {"0": 3}, r"Assign\.config\.stage_nodes\['0'\]: expected str, got int"),
    (["shared"], {"0": {"w": ["1"]}}, r"Assign\.config\.shared\['0'\]\['w'\]\[0\]: expected int"),
    (["recv_timeout_s"], "soon", r"Assign\.config\.recv_timeout_s: expected float"),
])
def test_a_mistyped_field_is_named(path: list[str], value: Any, expected: str) -> None:
    with pytest.raises(RemoteProtocolError, match=expected):
        Assign.from_wire(_bad(path, value))


def test_a_missing_field_is_named() -> None:
    header = _assign(CFG).to_wire()
    del header["config"]["optimizer"]["lr"]
    with pytest.raises(RemoteProtocolError, match=r"Assign\.config\.optimizer: missing field 'lr'"):
        Assign.from_wire(header)


def test_an_oversized_stage_map_is_refused_naming_it() -> None:
    many = {str(i): "a" for i in range(MAX_ASSIGN_STAGES + 1)}
    with pytest.raises(RemoteProtocolError, match=r"Assign\.config: invalid AssignConfig: "
                                                  r"stage_nodes has 4097 entries"):
        Assign.from_wire(_bad(["stage_nodes"], many))
    with pytest.raises(ValueError, match="stage_nodes"):
        dataclasses.replace(CFG, stage_nodes=many)


def test_the_data_config_carries_the_objective_and_the_transforms() -> None:
    data = dataclasses.replace(DATA, kind="jsonl", objective="masked_lm", layout="rows",
                               heldout=0.1, ignore_index=-1, mask_probability=0.2,
                               mask_token_id=4, decoder_start_token_id=None,
                               augment=("hflip", "crop"), mean=(0.5, 0.4), std=(0.2, 0.3))
    cfg = dataclasses.replace(CFG, data=data)
    assert _roundtrip(_assign(cfg)).config == cfg
