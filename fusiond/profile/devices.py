"""The accelerators of this machine, as its profile offers them (`NodeProfile.devices`).

A daemon owns its machine's CUDA devices and offers each one, measured on itself: kind, index,
name, memory, the planner's rate per op class (`fusiond.profile.calibrate.measure` on that
device), its bfloat16 matmul rate, and the host-device copy rates from and into pinned memory.

A CPU-only machine never initialises CUDA: `find_cuda` asks torch only where torch was built
with CUDA and the NVIDIA driver shows itself (`/proc/driver/nvidia/version` or
`/dev/nvidiactl`); elsewhere it returns nothing without calling into `torch.cuda`. A machine
whose driver is there but fails (a driver older than torch's CUDA, a device in a bad state)
says why in `NodeProfile.device_error`, which `fusionctl status` shows; a device that fails
its own calibration carries its `error` and is not planned on.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fusiond.plan.model import MachineProfile
from protocol.messages import MAX_PROFILE_DEVICES, MAX_PROFILE_TEXT_BYTES, DeviceProfile

log = logging.getLogger("fusiond.profile")

NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")
"""Where the NVIDIA driver shows itself without any CUDA call."""


@dataclass(frozen=True)
class FoundDevice:
    """A CUDA device as found, before it is measured."""

    index: int
    name: str = ""
    memory_bytes: int = 0
    free_bytes: int = 0
    error: str = ""


def _short(text: str) -> str:
    """`text` cut to what a profile's text field may hold."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= MAX_PROFILE_TEXT_BYTES:
        return text
    return raw[:MAX_PROFILE_TEXT_BYTES - 3].decode("utf-8", "ignore") + "..."


def cuda_expected(driver_files: tuple[str, ...] = NVIDIA_DRIVER_FILES) -> bool:
    """Whether this machine may have a usable CUDA device: torch built with CUDA and the NVIDIA
    driver present. Touches no CUDA API (`torch.version.cuda` is a constant of the build)."""
    import torch

    if getattr(torch.version, "cuda", None) is None:
        return False
    return any(Path(p).exists() for p in driver_files)


def find_cuda(driver_files: tuple[str, ...] = NVIDIA_DRIVER_FILES,
              owned: frozenset[int] | None = None) -> tuple[list[FoundDevice], str]:
    """The visible CUDA devices (of them, those in `owned`, None: all), and why CUDA cannot
    be used where the driver is present but fails ("" where nothing fails, and on a machine
    without CUDA, which this never initialises). Only the owned devices are opened (a
    daemon per GPU puts no context on its neighbours' GPUs)."""
    if not cuda_expected(driver_files):
        return [], ""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ok = bool(torch.cuda.is_available())
            count = int(torch.cuda.device_count()) if ok else 0
        except Exception as e:  # a broken driver raises from deep inside torch
            return [], _short(f"CUDA failed to initialise: {e!r}; check `nvidia-smi`")
    if not ok or count == 0:
        said = "; ".join(str(w.message) for w in caught) or "torch.cuda.is_available() is False"
        return [], _short(
            f"an NVIDIA driver is present but torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}) cannot use it: {said}. Check `nvidia-smi`; jobs that allow "
            "it train on this machine's CPU")
    found = []
    for i in range(min(count, MAX_PROFILE_DEVICES)):
        if owned is not None and i not in owned:
            continue
        try:
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            found.append(FoundDevice(i, _short(str(props.name)), int(total), int(free)))
        except Exception as e:
            found.append(FoundDevice(i, error=_short(f"cuda:{i} failed: {e!r}")))
    return found, ""


def device_profile(found: FoundDevice, machine: MachineProfile | None, *, kind: str = "cuda",
                   matmul_bf16_flop_per_s: float = 0.0, matmul_fp16_flop_per_s: float = 0.0,
                   h2d_bytes_per_s: float = 0.0,
                   d2h_bytes_per_s: float = 0.0, error: str = "") -> DeviceProfile:
    """A found device and its calibration (None: not measured, `error` says why) as the
    profile gossips it."""
    why = _short(error or found.error)
    if machine is None or why:
        return DeviceProfile(kind=kind, index=found.index, name=found.name,
                             memory_bytes=found.memory_bytes, free_bytes=found.free_bytes,
                             error=why or "not measured")
    return DeviceProfile(
        kind=kind, index=found.index, name=found.name, memory_bytes=found.memory_bytes,
        free_bytes=found.free_bytes,
        flop_per_s={c: float(r) for c, r in machine.flops.items()},
        matmul_bf16_flop_per_s=float(matmul_bf16_flop_per_s),
        matmul_fp16_flop_per_s=float(matmul_fp16_flop_per_s),
        mem_bw_bytes_per_s=float(machine.mem_bw),
        op_overhead_s=float(machine.op_overhead_s), h2d_bytes_per_s=float(h2d_bytes_per_s),
        d2h_bytes_per_s=float(d2h_bytes_per_s))


def measure_device(found: FoundDevice, *, kind: str = "cuda", repeats: int = 3,
                   scale: float = 1.0) -> DeviceProfile:
    """Calibrate one found device on itself (wall-clock rates: a GPU's work is not the host
    thread's CPU time). A failure is the device's `error`, never the daemon's."""
    if found.error:
        return device_profile(found, None, kind=kind)
    import torch

    from fusiond.profile.calibrate import copy_rates, matmul_rate, measure

    dev = f"{kind}:{found.index}"
    try:
        machine = measure(dev, device=dev, repeats=repeats, scale=scale,
                          memory_bytes=float(found.memory_bytes) or None,
                          per_cpu_second=False)
        bf16 = matmul_rate(dev, torch.bfloat16, repeats=repeats, scale=scale,
                           per_cpu_second=False)
        fp16 = matmul_rate(dev, torch.float16, repeats=repeats, scale=scale,
                           per_cpu_second=False)
        h2d, d2h = copy_rates(dev) if kind == "cuda" else (0.0, 0.0)
    except Exception as e:
        log.warning("device %s cannot be calibrated: %r", dev, e)
        return device_profile(found, None, kind=kind, error=f"{dev} failed its calibration: "
                                                            f"{e!r}")
    return device_profile(found, machine, kind=kind, matmul_bf16_flop_per_s=bf16,
                          matmul_fp16_flop_per_s=fp16, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h)


def devices_to_cache(devices: tuple[DeviceProfile, ...]) -> list[dict[str, Any]]:
    """The measured devices as the profile cache keeps them (their wire maps)."""
    return [d.to_wire() for d in devices]


def devices_from_cache(data: object) -> tuple[DeviceProfile, ...] | None:
    """The cached devices, or None where the cache holds none or a damaged list."""
    if not isinstance(data, list):
        return None
    try:
        out = []
        for item in data:
            got = DeviceProfile.from_wire(item)
            if not isinstance(got, DeviceProfile):
                return None
            out.append(got)
        return tuple(out)
    except Exception:
        return None


def with_free_memory(devices: tuple[DeviceProfile, ...], found: list[FoundDevice]
                     ) -> tuple[DeviceProfile, ...]:
    """The cached calibrations with the free memory read now."""
    free: Mapping[int, int] = {f.index: f.free_bytes for f in found}
    return tuple(replace(d, free_bytes=free.get(d.index, d.free_bytes)) for d in devices)
