"""Optimizer state on local disk: the disk tier of AutoHete's memory planner (issue 17).

A stage whose optimizer state does not fit its machine's memory keeps that state (AdamW's two
moments, SGD's momentum) in files, one per state tensor, memory-mapped: the optimizer's own
update (`torch.optim.AdamW` / `SGD`, unchanged) reads and writes them in place, so every
update is the plain run's, bit for bit. After each step the pages are written back and
dropped (`msync`, then `MADV_DONTNEED` and `POSIX_FADV_DONTNEED`), so between steps the state
costs no memory, and during a step only what the kernel pages in; the price is reading and
writing the state once per step (8 bytes per parameter each way for AdamW).

The update runs where the state lives, as ZeRO-Offload and AutoHete run Adam on the CPU: on
a CPU-only machine that is this process; the parameters and gradients stay in memory.

Files are created under `directory` (a job's stage state directory), 0600, and removed by
`close`; `state_dict` of the optimizer returns the mapped tensors (a checkpoint reads them).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fusiond.errors import LocalError

__all__ = ["DiskOptimizerState", "OffloadError", "state_bytes"]


class OffloadError(LocalError):
    """The optimizer state could not be placed on disk (no space, a bad directory)."""


@dataclass
class _Mapped:
    path: Path
    fd: int
    mm: mmap.mmap
    tensor: torch.Tensor


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of per-parameter state `opt` keeps (AdamW: two moments; SGD: a momentum buffer
    when momentum > 0), float32 like the parameters."""
    per = 0
    if isinstance(opt, torch.optim.AdamW | torch.optim.Adam):
        per = 2
    elif isinstance(opt, torch.optim.SGD):
        per = 1 if any(g.get("momentum", 0) for g in opt.param_groups) else 0
    return sum(per * p.numel() * p.element_size() for g in opt.param_groups
               for p in g["params"])


class DiskOptimizerState:
    """`opt`'s state in memory-mapped files under `directory` (see the module's docstring).

    Call `release()` after every `opt.step()` and `close()` at the end (idempotent)."""

    def __init__(self, opt: torch.optim.Optimizer, directory: Path) -> None:
        self.opt = opt
        self.directory = directory
        self._maps: list[_Mapped] = []
        self._closed = False
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    self._init_param(opt, group, p, f"g{gi}-p{pi}")
        except OSError as e:
            self.close()
            raise OffloadError(f"cannot keep the optimizer state in {directory}: {e}; free "
                               "disk space there or give the stage more memory") from e
        except BaseException:
            self.close()
            raise

    def _map(self, p: torch.Tensor, name: str) -> torch.Tensor:
        path = self.directory / f"{name}.f32"
        size = max(1, p.numel() * 4)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # no space: fail now, not mid-step with SIGBUS
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        arr = np.frombuffer(mm, dtype=np.float32, count=p.numel()).reshape(tuple(p.shape))
        t = torch.from_numpy(arr)  # zeros: a fresh file reads as zeros
        self._maps.append(_Mapped(path, fd, mm, t))
        return t

    def _init_param(self, opt: torch.optim.Optimizer, group: dict[str, object],
                    p: torch.Tensor, name: str) -> None:
        if p.dtype != torch.float32 or p.device.type != "cpu":
            raise OffloadError(f"optimizer state offload keeps float32 CPU state; parameter "
                               f"{name} is {p.dtype} on {p.device}")
        state = opt.state[p]
        if isinstance(opt, torch.optim.AdamW | torch.optim.Adam):
            if group.get("amsgrad"):
                raise OffloadError("optimizer state offload does not support amsgrad")
            # What AdamW's first step would create, already in place: it then skips its own
            # initialisation and updates these (`_init_group` initialises an empty state only).
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = self._map(p, f"{name}-m")
            state["exp_avg_sq"] = self._map(p, f"{name}-v")
        elif isinstance(opt, torch.optim.SGD):
            if group.get("momentum", 0):
                # SGD's first step sets the buffer to the gradient; from zeros,
                # buf * momentum + grad * (1 - dampening) is that gradient when dampening
                # is 0 (the only dampening `make_optimizer` uses)
                if group.get("dampening", 0):
                    raise OffloadError("optimizer state offload needs dampening 0")
                state["momentum_buffer"] = self._map(p, f"{name}-mom")
        else:
            raise OffloadError(f"no disk offload for {type(opt).__name__}")

    def release(self) -> None:
        """Write the state back and drop its pages (after `opt.step()`)."""
        for m in self._maps:
            m.mm.flush()
            with contextlib.suppress(OSError, AttributeError, ValueError):
                m.mm.madvise(mmap.MADV_DONTNEED)
            with contextlib.suppress(OSError):
                os.posix_fadvise(m.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    @property
    def nbytes(self) -> int:
        """Bytes of state on disk."""
        return sum(m.tensor.numel() * 4 for m in self._maps)

    def close(self) -> None:
        """Unmap and remove the files; idempotent. The optimizer's state no longer maps
        them: it is dropped."""
        if self._closed:
            return
        self._closed = True
        self.opt.state.clear()
        for m in self._maps:
            del m.tensor
            with contextlib.suppress(BufferError, ValueError):
                m.mm.close()
            with contextlib.suppress(OSError):
                os.close(m.fd)
            m.path.unlink(missing_ok=True)
        self._maps.clear()
