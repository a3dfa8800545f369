"""Where a stage computes: the CPU, or a CUDA device whose copies overlap its compute.

A stage's tensors cross between host memory (where the wire's bytes are decoded and encoded)
and its device at two places only: what it receives (activations, gradients, its data) goes
`onto` the device, what it sends (and what it sums with other holders of a parameter) comes
back to the `host`. On the CPU both are the tensors themselves: no copy, no CUDA call, so a
CPU-only machine never initialises CUDA.

On a CUDA device (`StagePlace("cuda:0")`):
- a received tensor lands in pinned (page-locked) host memory and is copied to the device on
  the place's own host-to-device stream, without blocking the compute thread; the compute
  stream waits on that copy's event, never on a global synchronize;
- what is sent waits on the compute stream's event on the place's device-to-host stream, is
  copied into pinned memory there, and the compute thread waits on that copy's event alone
  before the encoder reads the bytes, while the device goes on with the work queued behind;
- every tensor used on a stream other than the one that allocated it is recorded on it
  (`Tensor.record_stream`), so the caching allocator never hands its memory out while a copy
  still reads it.
The codec (top-k, quantization) runs on the host copy: the wire carries only the compressed
bytes either way; running it on the device first (less to copy back) is not built yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fusiond.errors import LocalError
from fusiond.plan.model import DEVICE_RE


class DeviceError(LocalError):
    """A stage cannot compute on the device its Assign names (no CUDA here, no such index)."""


def check_device(device: str) -> torch.device:
    """`device` as torch's, after checking that this machine has it (CUDA is touched only for
    a CUDA device)."""
    if not DEVICE_RE.fullmatch(device):
        raise DeviceError(f"device {device[:32]!r} is not \"cpu\" or \"cuda:N\"")
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise DeviceError(f"this machine has no usable CUDA device for {device} (torch "
                          f"{torch.__version__}, CUDA {torch.version.cuda}): train where a GPU "
                          "and a CUDA build of torch are, or on CPUs (job.device = \"cpu\"); a "
                          "daemon whose GPU went away offers it no more once restarted")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise DeviceError(f"{device} does not exist here: this machine has {count} CUDA "
                          "device(s)")
    return dev


class StagePlace:
    """The device of one stage and its copy streams (see the module's docstring)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = check_device(device)
        self.cuda = self.device.type == "cuda"
        self._h2d: Any = None
        self._d2h: Any = None
        if self.cuda:
            self._h2d = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self._d2h = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def __repr__(self) -> str:
        return f"StagePlace({str(self.device)!r})"

    def bind(self) -> None:
        """Make the place's device the calling thread's current one (the compute thread, at
        each step): pinned buffers and streams then belong to it, and a stage on cuda:1 puts
        nothing on cuda:0. Nothing on the CPU."""
        if self.cuda:
            torch.cuda.set_device(self.device)

    def onto(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host tensors -> the same values on the device (the same tensors on the CPU)."""
        if not self.cuda:
            return dict(tensors)
        compute = torch.cuda.current_stream(self.device)
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self._h2d):
            for key, t in tensors.items():
                if t.device == self.device:
                    out[key] = t
                    continue
                host = t if t.is_pinned() else t.pin_memory()
                out[key] = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._h2d)
        compute.wait_event(done)
        for key, t in out.items():
            if tensors[key] is not t:
                t.record_stream(compute)  # allocated on the copy stream, used on compute's
        return out

    def onto_one(self, t: torch.Tensor) -> torch.Tensor:
        """`onto` for one tensor."""
        return t if not self.cuda else self.onto({"t": t})["t"]

    def host(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Device tensors -> their values in (pinned) host memory, finished when this returns
        (the same tensors on the CPU)."""
        if not self.cuda:
            return dict(tensors)
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(compute)
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self._d2h):
            self._d2h.wait_event(ready)
            for key, t in tensors.items():
                if t.device.type != "cuda":
                    out[key] = t
                    continue
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t.detach(), non_blocking=True)
                t.record_stream(self._d2h)  # read on the copy stream: keep it until then
                out[key] = h
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._d2h)
        done.synchronize()  # this copy only: the device goes on with what is queued
        return out

    def host_one(self, t: torch.Tensor) -> torch.Tensor:
        """`host` for one tensor."""
        return t if not self.cuda else self.host({"t": t})["t"]
