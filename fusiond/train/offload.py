"""Optimizer state on local disk: the disk tier of AutoHete's memory planner (issue 17).

A stage whose optimizer state does not fit its machine's memory keeps that state (AdamW's two
moments, SGD's momentum) in files, one per state tensor, memory-mapped: the optimizer's own
update (`torch.optim.AdamW` / `SGD`, unchanged) reads and writes them in place, so every
update is the plain run's, bit for bit. After each step the pages are written back and
unmapped (`fdatasync`, then `MADV_DONTNEED`), so between steps the state holds no memory of
the process, only clean page cache the kernel reclaims first, and during a step what the
kernel pages in; the price is writing the state once per step and reading it again where the
page cache lost it (8 bytes per parameter each way for AdamW).

Stepped a chunk at a time (`step_in_chunks`), the transfers are scheduled around the compute,
as AutoHete's are: the next chunk's state is read ahead (`prefetch`: `MADV_WILLNEED`) while
this one steps, and each stepped chunk is written back by a writer thread (`release_behind`;
`fdatasync` leaves the GIL, `msync` held it) while the next one steps, at most
`WRITE_BEHIND_CHUNKS` of them pending; `drain` waits for them before the update returns.

The update runs where the state lives, as ZeRO-Offload and AutoHete run Adam on the CPU: on
a CPU-only machine that is this process; the parameters and gradients stay in memory.

Files are created under `directory` (a job's stage state directory), 0600, and removed by
`close`; `state_dict` of the optimizer returns the mapped tensors (a checkpoint reads them).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fusiond.errors import LocalError
from fusiond.heap import trim_heap

__all__ = ["DiskOptimizerState", "DiskParameters", "OffloadError", "state_bytes",
           "step_in_chunks", "trim_heap"]

WRITE_BEHIND_CHUNKS = 1
"""Chunks of optimizer state a `DiskOptimizerState` may have waiting for their write-back
while the next one steps (the update's memory: this many chunks more than one). One is
enough where writing a chunk takes less than stepping the next (7.5 against 9-10 ms on a
34-layer GPT-2 here)."""

PAGE_BYTES = mmap.PAGESIZE
"""Each tensor of a mapped file starts on a page, so releasing one never drops a neighbour's."""


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
        self._of: dict[int, list[_Mapped]] = {}
        """id(parameter) -> the maps of its state."""
        self._closed = False
        self._writer: ThreadPoolExecutor | None = None
        self._pending: deque[Future[None]] = deque()
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
        first = len(self._maps)
        try:
            self._init_state(opt, group, p, name, state)
        finally:
            self._of[id(p)] = self._maps[first:]

    def _init_state(self, opt: torch.optim.Optimizer, group: dict[str, object],
                    p: torch.Tensor, name: str, state: dict[str, object]) -> None:
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

    def _maps_of(self, params: Sequence[torch.Tensor] | None) -> list[_Mapped]:
        return (list(self._maps) if params is None
                else [m for p in params for m in self._of.get(id(p), ())])

    @staticmethod
    def _write_back(maps: Sequence[_Mapped]) -> None:
        for m in maps:
            # fdatasync writes the pages the mapping dirtied (Linux tracks them in the page
            # cache) and, unlike mmap.flush's msync, leaves the GIL while it waits
            os.fdatasync(m.fd)
            # unmapped, and clean: what stays in the page cache the kernel reclaims first,
            # and while it stays the next step reads it from memory (dropping it too,
            # POSIX_FADV_DONTNEED, made every update read the whole state from disk: 612
            # against 542 ms an update on a 34-layer GPT-2)
            with contextlib.suppress(OSError, AttributeError, ValueError):
                m.mm.madvise(mmap.MADV_DONTNEED)

    def release(self, params: Sequence[torch.Tensor] | None = None) -> None:
        """Write the state back and drop its pages (after `opt.step()`): of `params`' state
        only, or of all of it. Waits for any write-back still pending first."""
        self.drain()
        try:
            self._write_back(self._maps_of(params))
        except OSError as e:
            raise OffloadError(f"cannot write the optimizer state back to {self.directory}: "
                               f"{e}") from e

    def release_behind(self, params: Sequence[torch.Tensor]) -> None:
        """`release(params)` on the writer thread, so the next chunk steps meanwhile; blocks
        while `WRITE_BEHIND_CHUNKS` are already pending. `drain` before the state is read
        again as a whole (a checkpoint) or the update returns."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="fusion-write-back")
        while len(self._pending) >= WRITE_BEHIND_CHUNKS:
            self._wait(self._pending.popleft())
        self._pending.append(self._writer.submit(self._write_back, self._maps_of(params)))

    def prefetch(self, params: Sequence[torch.Tensor]) -> None:
        """Ask the kernel to read `params`' state ahead (`MADV_WILLNEED`): the chunk that
        steps next, while this one does."""
        for m in self._maps_of(params):
            with contextlib.suppress(OSError, AttributeError, ValueError):
                m.mm.madvise(mmap.MADV_WILLNEED)

    def _wait(self, fut: Future[None]) -> None:
        try:
            fut.result()
        except OSError as e:
            raise OffloadError(f"cannot write the optimizer state back to {self.directory}: "
                               f"{e}") from e

    def drain(self) -> None:
        """Wait for every pending write-back (the first failure is raised, `OffloadError`)."""
        first: OffloadError | None = None
        while self._pending:
            try:
                self._wait(self._pending.popleft())
            except OffloadError as e:
                first = first or e
        if first is not None:
            raise first

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
        with contextlib.suppress(OffloadError):  # the files go anyway
            self.drain()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self.opt.state.clear()
        self._of.clear()
        for m in self._maps:
            del m.tensor
            with contextlib.suppress(BufferError, ValueError):
                m.mm.close()
            with contextlib.suppress(OSError):
                os.close(m.fd)
            m.path.unlink(missing_ok=True)
        self._maps.clear()


def step_in_chunks(opt: torch.optim.Optimizer, chunks: Sequence[Sequence[torch.Tensor]],
                   after: Callable[[list[torch.Tensor]], None],
                   ahead: Callable[[list[torch.Tensor]], None] | None = None) -> None:
    """`opt.step()` over one chunk of its parameters at a time, calling `after(chunk)` behind
    each (to release that chunk's pages), so an update of state on disk never holds more than
    a chunk of it, and `ahead(next chunk)` before each step (to read the next one's state
    ahead). The same update as one `step()`: AdamW and SGD (foreach off) update every
    parameter on its own. A parameter in several chunks steps once, in its first; one in
    none steps with the last."""
    if len(opt.param_groups) != 1:
        raise OffloadError("a chunked update needs an optimizer with one parameter group")
    group = opt.param_groups[0]
    every: list[torch.Tensor] = group["params"]
    left = {id(p): p for p in every}
    try:
        for i, chunk in enumerate(chunks):
            todo = [p for p in chunk if left.pop(id(p), None) is not None]
            if i == len(chunks) - 1:
                todo += list(left.values())
                left.clear()
            if ahead is not None and i + 1 < len(chunks):
                ahead([p for p in chunks[i + 1] if id(p) in left])
            if todo:
                group["params"] = todo
                opt.step()
            after(todo)
    finally:
        group["params"] = every


@dataclass
class _Span:
    offset: int
    nbytes: int


class DiskParameters:
    """Parameters and their gradients in two memory-mapped files: the disk tier for the
    weights of a CPU-only machine short of memory (issue 17).

    Each parameter's values move into ``params.f32`` and its gradient is preallocated (zeros)
    in ``grads.f32``, both `MAP_SHARED`: the program, autograd (which accumulates into an
    existing ``.grad`` in place) and the optimizer read and write them where they are, so
    every value is the plain run's, bit for bit. What is resident is what was touched since
    the last release; `use(i)` (before segment i's forward) and `backward_done(i)` (once
    segment i's backward is through) keep only the segments next to the running one mapped
    and ask the kernel to read the next one ahead (`MADV_WILLNEED`): a released page is
    unmapped, and reading it again comes from the page cache, or from disk when the kernel
    had to reclaim it (a dirty page is written back first, never lost). `step` runs the
    optimizer one segment at a time and releases each behind it, so the update never holds
    more than a segment's weights, gradients and state.

    `groups[i]` names the parameters segment i reads (a tied parameter in several).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], groups: Sequence[Sequence[str]],
                 directory: Path) -> None:
        self.directory = directory
        self._params = dict(params)
        self._closed = False
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._paths: list[Path] = []
        self._span: dict[str, _Span] = {}
        offset = 0
        for name, p in self._params.items():
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise OffloadError(f"parameter offload keeps float32 CPU weights; {name} is "
                                   f"{p.dtype} on {p.device}")
            nbytes = p.numel() * 4
            self._span[name] = _Span(offset, nbytes)
            offset += -(-max(nbytes, 1) // PAGE_BYTES) * PAGE_BYTES
        self.nbytes = offset
        """Bytes of each of the two files."""
        known = set(self._params)
        self.groups = [[n for n in dict.fromkeys(g) if n in known] for g in groups] or [
            list(self._params)]
        grouped = {n for g in self.groups for n in g}
        rest = [n for n in self._params if n not in grouped]
        if rest:  # a parameter no segment reads still lives somewhere: with the last
            self.groups[-1] = [*self.groups[-1], *rest]
        self._resident: set[int] = set()
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            pmap = self._open("params.f32")
            gmap = self._open("grads.f32")
        except OSError as e:
            self.close()
            raise OffloadError(f"cannot keep the parameters in {directory}: {e}; free disk "
                               "space there or give the stage more memory") from e
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, p in self._params.items():
            sp = self._span[name]
            pv = self._view(pmap, sp, p)
            gv = self._view(gmap, sp, p)
            with torch.no_grad():
                pv.copy_(p.detach())
            p.data = pv
            p.grad = gv
            self._views[name] = (pv, gv)
        self.release_all()

    def _open(self, name: str) -> mmap.mmap:
        path = self.directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._fds.append(fd)
        self._paths.append(path)
        size = max(self.nbytes, PAGE_BYTES)
        os.posix_fallocate(fd, 0, size)  # no space: fail now, not mid-step with SIGBUS
        mm = mmap.mmap(fd, size)
        self._maps.append(mm)
        return mm

    @staticmethod
    def _view(mm: mmap.mmap, sp: _Span, p: torch.Tensor) -> torch.Tensor:
        arr = np.frombuffer(mm, dtype=np.float32, count=p.numel(), offset=sp.offset)
        return torch.from_numpy(arr).view(tuple(p.shape))

    def _advise(self, group: int, advice: int) -> None:
        for name in self.groups[group]:
            sp = self._span[name]
            length = -(-max(sp.nbytes, 1) // PAGE_BYTES) * PAGE_BYTES
            for mm in self._maps:
                with contextlib.suppress(OSError, ValueError):
                    mm.madvise(advice, sp.offset, length)

    def _keep(self, groups: set[int], ahead: int | None) -> None:
        for g in sorted(self._resident - groups):
            self._advise(g, mmap.MADV_DONTNEED)
        self._resident = {g for g in groups if 0 <= g < len(self.groups)}
        if ahead is not None and 0 <= ahead < len(self.groups) and ahead not in groups:
            self._advise(ahead, mmap.MADV_WILLNEED)
            self._resident.add(ahead)

    def use(self, group: int) -> None:
        """Segment `group`'s forward is next: keep it and the one before, read the next
        one ahead, release the rest."""
        self._keep({group - 1, group}, group + 1)

    def backward_done(self, group: int) -> None:
        """Segment `group`'s backward is through: the one before is next."""
        self._keep({group - 1}, group - 2)

    def release_all(self) -> None:
        """Unmap every page (they stay in the file, and in the page cache while it has room)."""
        for mm in self._maps:
            with contextlib.suppress(OSError, ValueError):
                mm.madvise(mmap.MADV_DONTNEED)
        self._resident.clear()

    def step(self, opt: torch.optim.Optimizer, state: DiskOptimizerState | None) -> None:
        """`opt.step()` one segment at a time, each segment's gradients zeroed and its pages
        (weights, gradients, and `state`'s optimizer state) released behind it; then every
        parameter's `.grad` is its mapped, zeroed gradient again."""
        name_of = {id(p): n for n, p in self._params.items()}
        chunks = [[self._params[n] for n in names] for names in self.groups]
        at = [0]

        def after(chunk: list[torch.Tensor]) -> None:
            for p in chunk:
                gv = self._views[name_of[id(p)]][1]
                if p.grad is not gv:  # a shared gradient the exchange replaced
                    p.grad = gv
                gv.zero_()
            if state is not None:
                state.release_behind(chunk)  # written back while the next segment steps
            self._advise(at[0], mmap.MADV_DONTNEED)
            at[0] += 1

        def ahead(chunk: list[torch.Tensor]) -> None:
            if state is not None:
                state.prefetch(chunk)
            self._advise(at[0] + 1, mmap.MADV_WILLNEED)

        try:
            step_in_chunks(opt, chunks, after, ahead)
        except BaseException:
            if state is not None:
                with contextlib.suppress(OffloadError):  # the first failure is the one raised
                    state.drain()
            raise
        if state is not None:
            state.drain()
        self._resident.clear()

    def flush(self) -> None:
        """Write dirty pages back (between steps): clean, what the page cache keeps of them
        the kernel may reclaim at once (`DiskOptimizerState` says why it is not dropped)."""
        for fd in self._fds:
            try:
                os.fdatasync(fd)  # the mapping's dirty pages too; msync would hold the GIL
            except OSError as e:
                raise OffloadError(f"cannot write the weights back to {self.directory}: "
                                   f"{e}") from e

    def close(self) -> None:
        """Remove the files and drop the gradients; idempotent. The parameters keep their
        mapped values (a final `state_dict` reads them) until they are dropped, which ends the
        mapping and frees the disk space; they are not copied back into memory, which may not
        hold them."""
        if self._closed:
            return
        self._closed = True
        for name in getattr(self, "_views", {}):
            self._params[name].grad = None
        self._views = {}
        for mm in self._maps:
            with contextlib.suppress(BufferError, ValueError):
                mm.close()
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for path in self._paths:
            path.unlink(missing_ok=True)
        self._maps.clear()
        self._fds.clear()
