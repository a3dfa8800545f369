"""Stages on devices (issue 18): the device a stage computes on, from the machine's profile
through the plan and the Assign to the executor, written once and tested here on the CPU;
the CUDA paths are the same code with a device argument, in the tests marked `gpu` (they skip
with the reason where CUDA is missing; scripts/gpu-check runs them where there is a GPU)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fusiond import profile as prof
from fusiond.errors import FusionError
from fusiond.graph import contiguous_assignment, partition
from fusiond.plan.model import MachineProfile, PlanError
from fusiond.profile import devices as dv
from fusiond.train.device import DeviceError, StagePlace, check_device
from fusiond.train.local import PipelineResult, run_pipeline
from fusiond.train.programs import cut_densities, stage_program, stage_programs
from fusiond.train.spec import JobSpecError, parse_job
from fusiond.train.stage import StageConfig, StageError
from protocol._schema import packb, unpackb
from protocol.errors import LocalProtocolError
from protocol.messages import DeviceProfile, NodeProfile

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine "
                                "(scripts/gpu-check runs these where there is one)")

GPU = DeviceProfile(kind="cuda", index=0, name="NVIDIA H100", memory_bytes=80 << 30,
                    free_bytes=79 << 30,
                    flop_per_s={"matmul": 4e14, "matmul_small": 1e14, "matmul_tiny": 1e13,
                           "conv": 2e14, "attention": 2e14, "other": 1e12},
                    matmul_bf16_flop_per_s=8e14, mem_bw_bytes_per_s=2e12, op_overhead_s=8e-6,
                    h2d_bytes_per_s=2.4e10, d2h_bytes_per_s=2.4e10)
CPU_RATES = dict(plan_flops_matmul=1.5e11, plan_flops_matmul_small=1.3e11,
                 plan_flops_other=2e9, plan_mem_bw=1e10, plan_op_overhead_s=2e-5,
                 plan_matmul_bf16_flop_per_s=6e11, plan_wire_s_per_byte=1e-9)


# -- the place: identity on the CPU, checked devices --------------------------------------------


def test_on_the_cpu_a_place_moves_nothing() -> None:
    place = StagePlace("cpu")
    t = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    assert not place.cuda
    for moved in (place.onto(t), place.host(t)):
        assert all(moved[k] is t[k] for k in t)
    assert place.onto_one(t["a"]) is t["a"] and place.host_one(t["b"]) is t["b"]


def test_a_device_that_is_not_here_is_refused_naming_it() -> None:
    with pytest.raises(DeviceError, match="is not \"cpu\" or \"cuda:N\""):
        check_device("gpu0")
    with pytest.raises(DeviceError, match="is not \"cpu\" or \"cuda:N\""):
        check_device("cuda:0; rm -rf /")
    if not CUDA:
        with pytest.raises(DeviceError, match="no usable CUDA device for cuda:0"):
            check_device("cuda:0")
    else:
        with pytest.raises(DeviceError, match="does not exist here"):
            check_device(f"cuda:{torch.cuda.device_count()}")


async def test_a_stage_assigned_a_missing_device_fails_as_its_machines_fault(
        captured_tiny: Any, small_text: Any) -> None:
    if CUDA:
        pytest.skip("this machine has CUDA: the device exists")
    _, cap = captured_tiny
    parts = partition(cap.graph, contiguous_assignment(cap.graph, 1))
    progs = stage_programs(cap.graph, parts, cap.state)
    with pytest.raises(StageError, match="stage 0: this machine has no usable CUDA device") as e:
        await run_pipeline(progs, data=small_text, batch_size=8, micro_batches=2,
                           optimizer=_adamw(), steps=1, config=StageConfig(device="cuda:0"))
    assert e.value.fault == "machine"


def _adamw() -> Any:
    from tests.train.test_recompute import ADAMW

    return ADAMW


# -- a CPU-only machine never initialises CUDA ----------------------------------------------------


def test_a_cpu_only_machine_never_initialises_cuda(tmp_path: Path) -> None:
    """Profiling (with its calibration) and training a stage in a fresh process leave CUDA
    uninitialised, whatever torch was built for (a CUDA build on a machine without the driver
    asks nothing of CUDA: `find_cuda` looks for the driver first)."""
    code = f"""
import asyncio, sys, torch
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from fusiond.profile import compute_profile
from fusiond.profile.devices import find_cuda
p = compute_profile({str(tmp_path)!r})
assert p.plan_flops_other > 0 and p.devices == () and p.device_kind == "cpu", p
assert find_cuda() == ([], "")
from fusiond.train.device import StagePlace
StagePlace("cpu").onto({{"x": torch.ones(2)}})
print("initialised", torch.cuda.is_initialized())
"""
    if dv.cuda_expected():
        pytest.skip("this machine has the NVIDIA driver and a CUDA torch")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "initialised False" in out.stdout


def test_a_driver_that_fails_is_said_in_the_profile(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch built for CUDA, the NVIDIA driver present, CUDA unusable (a driver older than
    torch's CUDA): the profile's `device_error` says so and what to run; no device offered."""
    driver = tmp_path / "version"
    driver.write_text("NVRM version: 470.00\n")
    monkeypatch.setattr(torch.version, "cuda", "12.4")

    def unavailable() -> bool:
        warnings.warn("The NVIDIA driver on your system is too old (found version 11040)",
                      stacklevel=1)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", unavailable)
    found, error = dv.find_cuda((str(driver),))
    assert found == []
    assert "NVIDIA driver is present" in error and "too old" in error
    assert "nvidia-smi" in error and len(error.encode()) <= 256
    NodeProfile(device_error=error)  # within the profile's bounds

    def boom() -> bool:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    _, error = dv.find_cuda((str(driver),))
    assert "CUDA failed to initialise" in error and "driver initialization failed" in error
    assert dv.find_cuda((str(tmp_path / "absent"),)) == ([], "")
    # a working driver: only the devices this daemon owns are opened (one daemon per GPU)
    opened: list[int] = []

    def mem_get_info(i: int) -> tuple[int, int]:
        opened.append(i)
        return (7 << 30, 8 << 30)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name=f"GPU {i}"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    found, error = dv.find_cuda((str(driver),), owned=frozenset({2}))
    assert error == "" and [(f.index, f.name, f.free_bytes) for f in found] == [
        (2, "GPU 2", 7 << 30)] and opened == [2]
    assert [f.index for f in dv.find_cuda((str(driver),))[0]] == [0, 1, 2]


# -- the device's calibration, on the CPU as the same code with another device -------------------


def test_a_device_is_calibrated_on_itself_and_its_failure_is_its_own() -> None:
    found = dv.FoundDevice(0, "test device", 8 << 30, 7 << 30)
    d = dv.measure_device(found, kind="cpu", repeats=1, scale=0.1)
    assert not d.error and d.device == "cpu:0" and d.name == "test device"
    assert not d.usable  # measured, but only a CUDA device is planned on
    assert d.flop_per_s["matmul"] > 0 and d.flop_per_s["other"] > 0 and d.matmul_bf16_flop_per_s > 0
    assert d.matmul_fp16_flop_per_s > 0
    assert d.mem_bw_bytes_per_s > 0 and d.memory_bytes == 8 << 30
    assert d.h2d_bytes_per_s == 0  # no copy between host and the host
    back = dv.devices_from_cache(dv.devices_to_cache((d,)))
    assert back == (d,)
    assert dv.devices_from_cache([{"kind": 3}]) is None and dv.devices_from_cache("x") is None
    bad = dv.measure_device(dv.FoundDevice(1, error="cuda:1 failed: ECC error"))
    assert not bad.usable and "ECC" in bad.error


# -- the profile on the wire, and the planner's view of a device --------------------------------


def test_a_profile_with_devices_round_trips_and_bounds_them() -> None:
    p = NodeProfile(device_kind="cuda", devices=(GPU, dataclasses.replace(GPU, index=1)),
                    **CPU_RATES)  # type: ignore[arg-type]
    back = NodeProfile.from_wire(unpackb(packb(p.to_wire()), "profile"))
    assert back == p and back.devices[1].device == "cuda:1"
    with pytest.raises(ValueError, match="devices has 17 items"):
        NodeProfile(devices=(GPU,) * 17)
    assert not dataclasses.replace(GPU, index=-1).usable  # a peer's nonsense is not planned on
    assert not dataclasses.replace(GPU, flop_per_s={"other": float("nan")}).usable
    assert not dataclasses.replace(GPU, kind="tpu").usable and GPU.usable
    with pytest.raises(ValueError, match="flop_per_s has 17 entries"):
        DeviceProfile(kind="cuda", index=0, flop_per_s={str(i): 1.0 for i in range(17)})


def test_the_job_device_policy_picks_each_machines_device() -> None:
    gpu = NodeProfile(devices=(dataclasses.replace(GPU, error="cuda:0 failed"), GPU
                               if False else dataclasses.replace(GPU, index=1)),
                      **CPU_RATES)  # type: ignore[arg-type]
    cpu = NodeProfile(**CPU_RATES)  # type: ignore[arg-type]
    broken = NodeProfile(device_error="driver too old", **CPU_RATES)  # type: ignore[arg-type]
    assert prof.stage_device(gpu, "auto") == "cuda:1"  # the first usable one
    assert prof.stage_device(gpu, "cpu") == "cpu"
    assert prof.stage_device(cpu, "auto") == "cpu" and prof.stage_device(cpu, "cuda") is None
    assert prof.stage_device(broken, "auto") == "cpu"  # the job allows the fallback
    assert prof.stage_device(broken, "cuda") is None  # this one does not
    with pytest.raises(ValueError, match="device policy 'tpu'"):
        prof.stage_device(cpu, "tpu")


def test_a_stage_on_a_gpu_is_priced_by_the_gpus_own_rates_and_memory() -> None:
    node = NodeProfile(devices=(GPU,), **CPU_RATES)  # type: ignore[arg-type]
    m = prof.machine_from_profile("g", node, 16e9, device="cuda:0")
    assert m is not None and m.device == "cuda:0"
    assert m.flops["matmul"] == 4e14 and m.memory_bytes == 79 << 30
    assert m.wire_s_per_byte == 1e-9  # the host still moves the bytes
    c = prof.machine_from_profile("g", node, 16e9, device="cpu")
    assert c is not None and c.device == "cpu" and c.flops["matmul"] == 1.5e11
    assert c.memory_bytes == 16e9
    # bf16: the matmul classes at the measured bf16 rate over the fp32 one, the rest as they are
    b = prof.machine_from_profile("g", node, 16e9, device="cuda:0", precision="bf16")
    assert b is not None and b.flops["matmul"] == 8e14 and b.flops["matmul_small"] == 2e14
    assert b.flops["other"] == 1e12
    cb = prof.machine_from_profile("g", node, 16e9, device="cpu", precision="bf16")
    assert cb is not None and cb.flops["matmul"] == pytest.approx(6e11)
    # fp16 at its own measured rate; where none was measured, at the float32 rates
    h = prof.machine_from_profile("g", dataclasses.replace(
        node, devices=(dataclasses.replace(GPU, matmul_fp16_flop_per_s=6e14),)), 16e9,
        device="cuda:0", precision="fp16")
    assert h is not None and h.flops["matmul"] == pytest.approx(6e14)
    ch = prof.machine_from_profile("g", node, 16e9, device="cpu", precision="fp16")
    assert ch is not None and ch.flops["matmul"] == 1.5e11
    assert prof.machine_from_profile("g", node, 16e9, device="cuda:3") is None
    assert MachineProfile.from_dict(m.to_dict()) == m
    with pytest.raises(PlanError, match="is not \"cpu\" or \"cuda:N\""):
        dataclasses.replace(m, device="tpu:0")


def test_a_cuda_job_plans_on_gpu_machines_only_and_says_why_none() -> None:
    from types import SimpleNamespace

    from fusiond.jobs.planning import JobRefused, cluster_for_planner

    def member(name: str, p: NodeProfile) -> Any:
        return SimpleNamespace(node_id=name, address=("127.0.0.1", 1), state="alive", profile=p)

    def view(*members: Any) -> Any:  # what cluster_for_planner reads of a ClusterView
        return SimpleNamespace(members=members, links={})

    gpu = NodeProfile(devices=(GPU,), memory_bytes=64 << 30, **CPU_RATES)  # type: ignore[arg-type]
    cpu = NodeProfile(memory_bytes=8 << 30, **CPU_RATES)  # type: ignore[arg-type]
    broken = NodeProfile(device_error="an NVIDIA driver is present but ...", memory_bytes=8 << 30,
                         **CPU_RATES)  # type: ignore[arg-type]
    both = view(member("a", gpu), member("b", cpu))
    cluster, _, memory = cluster_for_planner(both, device="auto")
    by = {m.id: m for m in cluster.machines}
    assert by["a"].device == "cuda:0" and by["b"].device == "cpu"
    assert memory["a"] == 79 << 30
    only, _, _ = cluster_for_planner(both, device="cuda")
    assert only.ids() == ["a"]
    none = view(member("b", cpu), member("c", broken))
    with pytest.raises(JobRefused, match=r"job.device = 'cuda' but no alive member") as e:
        cluster_for_planner(none, device="cuda")
    assert "c: an NVIDIA driver is present" in str(e.value) and "b: no CUDA device" in str(
        e.value)
    assert isinstance(e.value, FusionError)


def test_the_job_device_setting_is_read_and_checked() -> None:
    def job(extra: str) -> str:
        return ('[job]\nname = "d"\nsteps = 2\n' + extra
                + '[model]\nzoo = "gpt2"\nconfig = { size = "tiny" }\n')

    assert parse_job(job("")).device == "auto"
    assert parse_job(job('device = "cuda"\n')).device == "cuda"
    with pytest.raises(JobSpecError, match=r"job\.device"):
        parse_job(job('device = "tpu"\n'))


# -- the Assign carries each slot's device ---------------------------------------------------------


def test_an_assign_names_each_slots_device_and_refuses_a_bad_one(captured_tiny: Any) -> None:
    from fusiond.jobs.assign import assign_messages, layout_job
    from fusiond.train.remote import decode_assign
    from fusiond.train.spec import parse_job as parse

    _, cap = captured_tiny
    spec = parse('[job]\nname = "d"\nsteps = 2\n[model]\nzoo = "gpt2"\nconfig = { size = "tiny" }\n'
                 '[batch]\nsize = 8\nmicro_batch_size = 4\n[data]\nseq_len = 64\n')
    cut = contiguous_assignment(cap.graph, 2)
    layout = layout_job("j", cap.graph, cap.state, {op: ("a", "b")[s] for op, s in cut.items()})
    layout = dataclasses.replace(layout, devices={"b": "cuda:1"})
    msgs = assign_messages(layout, spec, cap.state, term=1, plan_version=1,
                           addresses={"a": ("127.0.0.1", 1), "b": ("127.0.0.1", 2)})
    (ma, pa), (mb, pb) = msgs["a"], msgs["b"]
    assert mb.config is not None and mb.config.slot_devices == {"1": "cuda:1"}
    assert decode_assign(ma, pa).device == "cpu" and decode_assign(mb, pb).device == "cuda:1"
    bad = dataclasses.replace(mb, config=dataclasses.replace(mb.config,
                                                             slot_devices={"1": "cuda:x"}))
    with pytest.raises(FusionError, match=r"slot_devices\[1\]: 'cuda:x' is not"):
        decode_assign(bad, pb)
    bad = dataclasses.replace(mb, config=dataclasses.replace(mb.config,
                                                             slot_devices={"7": "cuda:0"}))
    with pytest.raises(FusionError, match="slot_devices: '7' is not a slot"):
        decode_assign(bad, pb)
    # the plan's gradient buckets travel the same way, and are bounded
    layout = dataclasses.replace(layout, grad_buckets={"b": 3})
    (_, _), (mb, pb) = assign_messages(
        layout, spec, cap.state, term=1, plan_version=1,
        addresses={"a": ("127.0.0.1", 1), "b": ("127.0.0.1", 2)}).values()
    assert decode_assign(mb, pb).grad_buckets == 3
    for value, why in (({"1": 0}, r"grad_buckets\[1\]: 0 is not a bucket count"),
                       ({"1": 5000}, r"grad_buckets\[1\]: 5000 is not"),
                       ({"x": 2}, "grad_buckets: 'x' is not a slot")):
        bad = dataclasses.replace(mb, config=dataclasses.replace(mb.config, grad_buckets=value))
        with pytest.raises(FusionError, match=why):
            decode_assign(bad, pb)


# -- on a GPU: partitioned equals unpartitioned there, and a CPU stage beside a GPU stage ---------


async def _train(cap: Any, data: Any, devices: list[str], precision: str = "fp32",
                 steps: int = 3) -> PipelineResult:
    parts = partition(cap.graph, contiguous_assignment(cap.graph, len(devices)))
    from fusiond.train.programs import graph_data_names, shared_params

    stage_of = {p.id: i for i, p in enumerate(parts)}
    shared = shared_params(parts, stage_of, cap.state)
    main, targets = graph_data_names(cap.graph)
    progs = [stage_program(p, cap.state, stage_of=stage_of, input_name=main,
                           targets_name=targets, shared=shared[i], device=devices[i])
             for i, p in enumerate(parts)]
    return await run_pipeline(progs, data=data, batch_size=8, micro_batches=4,
                              optimizer=_adamw(), steps=steps,
                              config=StageConfig(precision=precision), devices=devices)


async def test_stages_with_explicit_cpu_devices_train_as_before(captured_tiny: Any,
                                                                small_text: Any) -> None:
    """The device plumbing itself (`stage_program(device=...)`, `run_pipeline(devices=...)`)
    on the CPU: the same losses and weights, bit for bit, as the default path."""
    _, cap = captured_tiny
    plain = await run_pipeline(
        stage_programs(cap.graph, partition(cap.graph, contiguous_assignment(cap.graph, 3)),
                       cap.state), data=small_text, batch_size=8, micro_batches=4,
        optimizer=_adamw(), steps=3)
    placed = await _train(cap, small_text, ["cpu", "cpu", "cpu"])
    assert placed.losses == plain.losses
    for s, state in placed.states.items():
        for k, v in state.items():
            assert torch.equal(v, plain.states[s][k]), k


@pytest.mark.gpu
@needs_cuda
async def test_partitioned_on_one_gpu_equals_unpartitioned_on_it(captured_tiny: Any,
                                                                  small_text: Any) -> None:
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    _, cap = captured_tiny
    whole = await _train(cap, small_text, ["cuda:0"])
    cut = await _train(cap, small_text, ["cuda:0"] * 3)
    for got, want in zip(cut.losses, whole.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    merged = {k: v for st in cut.states.values() for k, v in st.items()}
    for k, v in whole.states[0].items():
        assert v.device.type == "cpu"  # results come back to the host
        assert torch.allclose(merged[k], v, rtol=1e-5, atol=1e-6), k


@pytest.mark.gpu
@needs_cuda
async def test_a_cpu_stage_beside_a_gpu_stage_trains_as_all_cpu(captured_tiny: Any,
                                                                small_text: Any) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    _, cap = captured_tiny
    cpu = await _train(cap, small_text, ["cpu", "cpu", "cpu"])
    mixed = await _train(cap, small_text, ["cpu", "cuda:0", "cpu"])
    for got, want in zip(mixed.losses, cpu.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.gpu
@needs_cuda
async def test_bf16_on_a_gpu_cut_in_three_trains_as_one_stage(captured_tiny: Any,
                                                              small_text: Any) -> None:
    _, cap = captured_tiny
    whole = await _train(cap, small_text, ["cuda:0"], precision="bf16")
    cut = await _train(cap, small_text, ["cuda:0"] * 3, precision="bf16")
    for got, want in zip(cut.losses, whole.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-3)


# -- one daemon per GPU: the `gpus` key ------------------------------------------------------------


def test_the_gpus_key_names_the_devices_a_daemon_owns(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from fusiond.config import ConfigError, gpu_indices, load_config

    assert gpu_indices("all") is None and gpu_indices("none") == frozenset()
    assert gpu_indices(" 0,2 ") == frozenset({0, 2}) and gpu_indices("gpu0") == "bad"
    assert gpu_indices("-1") == "bad"
    with pytest.raises(ConfigError, match=r"gpus = 'first' .*must be all, none, or CUDA"):
        load_config(env={"FUSION_GPUS": "first", "FUSION_STATE_DIR": str(tmp_path)})
    # the devices this daemon owns, measured; the others left to the daemons that own them
    found = [dv.FoundDevice(i, f"gpu{i}", 8 << 30, 8 << 30) for i in range(3)]
    monkeypatch.setattr(dv, "find_cuda", lambda *a, owned=None: (
        [f for f in found if owned is None or f.index in owned], ""))
    monkeypatch.setattr(dv, "measure_device",
                        lambda f, **kw: dataclasses.replace(GPU, index=f.index, name=f.name))
    cache = tmp_path / "profile.json"
    got = prof._accelerators(cache, "2.13.0", frozenset({1}))
    assert [d.index for d in got["devices"]] == [1] and got["device_name"] == "gpu1"
    assert prof._accelerators(cache, "2.13.0", frozenset()) == {"device_error": ""}
    both = prof._accelerators(cache, "2.13.0", None)
    assert [d.device for d in both["devices"]] == ["cuda:0", "cuda:1", "cuda:2"]
    assert json.loads((tmp_path / "devices.json").read_text())["devices"][2]["index"] == 2


# -- compression where the tensor lies: the device codecs, checked byte for byte on the CPU ------


def _distinct(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Every magnitude distinct in `dtype` (consecutive bit patterns of positive normal
    numbers, shuffled, random signs): the top-k is unique, per row and over the whole."""
    n = int(torch.tensor(shape).prod())
    start = {torch.float16: 0x1000, torch.bfloat16: 0x3C00}.get(dtype)
    if start is None:
        mags = (torch.arange(n, dtype=torch.float64) + 1).to(dtype)
    else:
        mags = torch.arange(start, start + n, dtype=torch.int16).view(dtype)
    mags = mags[torch.randperm(n, generator=g)]
    signs = (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(dtype)
    return (mags * signs).reshape(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 16, 128), (3, 7), (200,), (5, 256)])
def test_the_device_codecs_write_the_host_codecs_bytes(dtype: torch.dtype,
                                                        shape: tuple[int, ...]) -> None:
    """A GPU stage compresses on the GPU (`codec.encode_*_torch`: top-k, the gradient's values
    at its indices, int8 to nearest) and sends the bytes the host codecs write: the same
    torch code, run here on the CPU."""
    from fusiond.train import codec

    g = torch.Generator().manual_seed(sum(shape))
    host = StagePlace("cpu").host
    t = _distinct(shape, dtype, g)
    for per_row in (True, False):
        for density in (0.1, 0.5, 1.0):
            a, ia = codec.encode_topk(t, density, per_row)
            b, ib = codec.encode_topk_torch(t, density, per_row, host)
            assert a.payload == b.payload and np.array_equal(ia, ib), (per_row, density)
            assert a.dense_nbytes == b.dense_nbytes
            grad = torch.randn(shape, generator=g).to(dtype)
            assert codec.encode_values(grad, ia).payload == \
                codec.encode_values_torch(grad, ia, host).payload
    noisy = torch.randn(shape, generator=g).to(dtype)
    assert codec.encode_int8(noisy).payload == codec.encode_int8_torch(noisy, host).payload
    zeros = torch.zeros(shape, dtype=dtype)
    assert codec.encode_int8(zeros).payload == codec.encode_int8_torch(zeros, host).payload
    bad = noisy.clone().float()
    bad.reshape(-1)[0] = float("inf")
    with pytest.raises(LocalProtocolError, match="finite"):
        codec.encode_int8_torch(bad, host)
    assert codec.reduces_on_device(t, 0.1, "raw") is (t.device.type == "cuda")


@pytest.mark.gpu
@needs_cuda
async def test_compressed_edges_on_a_gpu_send_what_the_cpu_sends(captured_tiny: Any,
                                                                 small_text: Any) -> None:
    """Top-k (density 0.1) and int8 cut edges between GPU stages are compressed on the GPU:
    as many bytes on the wire per edge as the CPU pipeline sends, and the same training to
    the GPU's rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _, cap = captured_tiny
    parts = partition(cap.graph, contiguous_assignment(cap.graph, 3))
    for kind in ("topk", "int8"):
        runs = {}
        for dev in ("cpu", "cuda:0"):
            cut = cut_densities(parts, 0.1)
            progs = stage_programs(cap.graph, parts, cap.state, device=dev,
                                   densities=cut if kind == "topk" else None,
                                   int8_edges=list(cut) if kind == "int8" else ())
            runs[dev] = await run_pipeline(progs, data=small_text, batch_size=8,
                                           micro_batches=4, optimizer=_adamw(), steps=2,
                                           devices=[dev] * 3)
        for a, b in zip(runs["cpu"].metrics, runs["cuda:0"].metrics, strict=True):
            # (the index stream's varints, and lz4 where it pays, follow the values: within 5 %)
            wa = {e.edge: e.forward_wire for e in a.edges}
            wb = {e.edge: e.forward_wire for e in b.edges}
            assert wa.keys() == wb.keys(), kind
            assert all(abs(wa[k] - wb[k]) <= 0.05 * wa[k] for k in wa), (kind, wa, wb)
        for got, want in zip(runs["cuda:0"].losses, runs["cpu"].losses, strict=True):
            assert got == pytest.approx(want, rel=1e-3), kind
