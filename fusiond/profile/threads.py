"""How many threads torch may run on this node: no more than the cores it may keep busy.

torch sizes its intra-op pool by the machine's cores and ignores a cgroup CPU quota, so a
daemon in a 0.5-core container (or several stage daemons sharing two cores) runs two compute
threads on half a core: each CFS period the quota is spent in half the time, then both threads
stall for the rest of it, and every hand-off between stages waits that out (issue 15: the
multi-process variant "oversubscribes 2 cores"). The rule: threads = the allowance's cores
rounded up (a 1.5-core quota keeps two threads busy 75 % of the time, which is what it allows),
at least 1, and never more than torch's own default (the physical cores). An operator who set
`OMP_NUM_THREADS` chose for themselves: that is kept.

`threads_for` is the pure rule; `apply_cpu_allowance` reads the allowance, applies it to torch
once at process start (the `fusiond` command does, before the profile is measured, so the
profile's `threads` and the planner's sustained rates are the runtime's) and says what it did.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from fusiond.profile import CpuAllowance, cpu_allowance

__all__ = ["ThreadChoice", "apply_cpu_allowance", "threads_for"]


def threads_for(cores: float, torch_default: int) -> int:
    """Compute threads for an allowance of `cores`: ceil(cores), at least 1, at most torch's
    default."""
    if not math.isfinite(cores) or cores <= 0:
        return max(1, torch_default)
    return max(1, min(max(1, torch_default), math.ceil(cores - 1e-9)))


@dataclass(frozen=True)
class ThreadChoice:
    """What `apply_cpu_allowance` did: `threads` now, torch's `default`, and `why` (for the
    log line)."""

    threads: int
    default: int
    why: str


def apply_cpu_allowance(allowance: CpuAllowance | None = None,
                        env: Mapping[str, str] | None = None) -> ThreadChoice:
    """Set torch's intra-op (and, while still possible, inter-op) thread count from this
    process's CPU allowance. Kept as it is when `OMP_NUM_THREADS` is set."""
    import torch

    env = os.environ if env is None else env
    default = torch.get_num_threads()
    if env.get("OMP_NUM_THREADS"):
        return ThreadChoice(default, default, "OMP_NUM_THREADS is set: torch's choice kept")
    allowance = allowance or cpu_allowance()
    n = threads_for(allowance.cores, default)
    if n != default:
        torch.set_num_threads(n)
        # only possible before any inter-op work has run; the daemon calls this first thing
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(n)
    return ThreadChoice(n, default, f"{allowance.cores:g} cores allowed ({allowance.source})")
