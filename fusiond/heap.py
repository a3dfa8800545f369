"""This process's C heap: what it holds resident, and giving its free pages back.

Why a training process needs both: glibc raises its mmap threshold as big blocks are freed (up
to 32 MiB; `fusiond.net.tune_allocator` raises it to 1 GiB on purpose, so received frames
reuse freed buffers), so tensors come from the heap, and what a backward or an update frees
stays resident, fragmented, until trimmed. The planner counts the live training state; the
kernel counts resident pages. Measured on the WAN bench's model (GPT-2 6 x 256, two replicas
of the whole model, one process): 200 MiB resident per replica against 156 MiB planned, 162
MiB with the heap trimmed after every backward and update, at 15 % more step time (the
trimmed pages fault in again). So a stage trims on every task only under a memory decision,
and otherwise only when its process nears its memory limit (`near_limit`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any, Final

__all__ = ["HIGH_WATER", "near_limit", "resident_anon_bytes", "trim_heap"]

HIGH_WATER: Final = 0.85
"""The share of its memory limit past which a process trims its heap (`near_limit`): the
planner fills at most `JobSettings.memory_fraction` (0.9) of what is left after the idle
process, so a process at its plan's peak sits at about 0.9-0.95 of the limit."""

_LIBC: Any = None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the kernel (glibc's `malloc_trim(0)`); False
    where the C library has none.

    Measured under a memory plan (GPT-2 width 256, 21 layers, eager): the peak was 17 % over
    the training state the planner counts without it, 4 % with it after every backward and
    update (a fixed 128 KiB mmap threshold also matched the prediction, at 1.5x the step
    time)."""
    global _LIBC
    if _LIBC is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") else False
        except OSError:
            _LIBC = False
    if _LIBC is False:
        return False
    _LIBC.malloc_trim(0)
    return True


_PAGE_BYTES: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_anon_bytes(statm: str = "/proc/self/statm") -> int | None:
    """This process's resident memory that is not file-backed (`/proc/self/statm`: resident
    less shared pages), in bytes: what the kernel cannot drop under pressure. One short read
    (a few microseconds); None where the file is missing or odd."""
    try:
        with open(statm, "rb") as f:
            fields = f.read(256).split()
        return (int(fields[1]) - int(fields[2])) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def near_limit(limit_bytes: float | None, high_water: float = HIGH_WATER) -> bool:
    """Whether this process holds more than `high_water` of `limit_bytes` (None: no limit,
    never) in resident anonymous memory."""
    if limit_bytes is None or limit_bytes <= 0:
        return False
    held = resident_anon_bytes()
    return held is not None and held > high_water * limit_bytes
