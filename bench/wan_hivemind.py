"""hivemind 1.1.12 baseline for `bench/wan.py`: one peer per testbed host, run with the
hivemind venv's Python (`bench/hivemind/setup.sh`), not the project's.

Every peer builds the same GPT-2 (`fusiond.models.gpt2`, torch only, same seed as fusion's
`build_model`) and trains with `hivemind.Optimizer` (AdamW, same lr) as hivemind's quickstart
configures it: local updates (each peer steps its optimizer every local step; the parameters
and optimizer state are averaged once per collaborative epoch), `matchmaking_time` 3 s and
`averaging_timeout` 10 s, fp16 compression of the averaged gradients and state; the
`target_batch_size` of one epoch is `--epoch-batches` global batches (default 4; the docs use
thousands of samples, which this budget cannot reach). Each local step is the peer's 1/world
share of a batch drawn like fusion's (`window_offsets` over the training split's tokens,
saved by wan.py). Peer 0 saves its dense weights at fixed wall-clock points and at the end
(`bench.wan_eval.save_snapshot`) for the held-out evaluator.
Peer 0 starts the DHT and writes its multiaddrs to `--maddr-file`; the others join from it.
A trace event is written each time the collaboration finishes a global step (epoch), with the
mean of peer 0's local losses since the previous one. All peers start the clock together:
each one, once its DHT and Optimizer are up, marks itself ready in `--barrier-dir` and waits for
all `--world` marks (as DDP's rendezvous holds every rank until all are there); without it the
first peer would fill the target batch alone while the others are still starting. Each peer
stops at its own budget from that common start.

    .venv-hivemind/bin/python bench/wan_hivemind.py --rank R --world W --listen ADDR:PORT \
        --maddr-file F --budget 60 --workload workload.json --tokens tokens.npy --out trace.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench.wan_common import Trace, Workload, window_offsets
from fusiond.models.gpt2 import gpt2, lm_loss

T_PROCESS = time.perf_counter()
"""After the imports: start-up (reported apart from the budget) is what follows them."""


def barrier(root: Path, rank: int, world: int, timeout_s: float = 300.0) -> None:
    """Mark `rank` ready under `root` and return once all `world` ranks are (SystemExit after
    `timeout_s`: a peer that never came up). The directory is shared by every host (one
    machine); polling a few files costs nothing next to a training step."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"ready-{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while sum(1 for r in range(world) if (root / f"ready-{r}").exists()) < world:
        if time.monotonic() > deadline:
            raise SystemExit(f"start barrier: not every peer of {world} became ready")
        time.sleep(0.02)


def main() -> None:
    import hivemind

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--listen", required=True, help="ADDR:PORT for this peer's libp2p host")
    ap.add_argument("--maddr-file", required=True)
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--tokens", required=True, help=".npy of the corpus tokens (int64)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--barrier-dir", required=True,
                    help="shared directory: every peer's ready mark; training starts when all "
                         "--world peers are there")
    ap.add_argument("--matchmaking-time", type=float, default=3.0,
                    help="hivemind's wait to form an averaging group (its quickstart: 3 s)")
    ap.add_argument("--epoch-batches", type=int, default=4,
                    help="target_batch_size = this many global batches")
    ap.add_argument("--snapshot-dir", required=True, type=Path)
    ap.add_argument("--snapshot-interval", type=float, default=5.0)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    wl = Workload.from_dict(json.loads(Path(args.workload).read_text()))
    tokens = np.load(args.tokens)
    addr, _, port = args.listen.rpartition(":")
    maddr_file = Path(args.maddr_file)
    initial: list[str] = []
    if args.rank > 0:
        deadline = time.monotonic() + 120
        while not maddr_file.exists() or not maddr_file.read_text().strip():
            if time.monotonic() > deadline:
                raise SystemExit("peer 0 never published its multiaddrs")
            time.sleep(0.2)
        initial = maddr_file.read_text().split()
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{addr}/tcp/{port}"], initial_peers=initial,
                       start=True)
    if args.rank == 0:
        maddrs = [str(a) for a in dht.get_visible_maddrs() if addr in str(a)]
        tmp = maddr_file.with_suffix(".tmp")
        tmp.write_text("\n".join(maddrs))
        tmp.rename(maddr_file)
    torch.manual_seed(wl.seed)
    model = gpt2(wl.size, **wl.model_overrides())
    share = wl.batch // args.world
    from hivemind.compression import Float16Compression

    opt = hivemind.Optimizer(
        dht=dht, run_id="bench-wan", batch_size_per_step=share,
        target_batch_size=wl.batch * args.epoch_batches,
        optimizer=lambda params: torch.optim.AdamW(params, lr=wl.lr, betas=(0.9, 0.95),
                                                   eps=1e-8, weight_decay=0.0),
        params=model.parameters(), use_local_updates=True,
        matchmaking_time=args.matchmaking_time, averaging_timeout=10.0,
        grad_compression=Float16Compression(), state_averaging_compression=Float16Compression(),
        verbose=False,
    )
    from bench.wan_eval import SnapshotClock, save_snapshot

    clock = SnapshotClock(args.snapshot_interval)
    snaps = 0
    barrier(Path(args.barrier_dir), args.rank, args.world)
    # the common start (hivemind ships no weights: every peer built the same seeded model)
    t0 = time.perf_counter()
    startup_s = t0 - T_PROCESS  # DHT, Optimizer, the start barrier
    events: list[tuple[float, int, float | None, int]] = []
    pending: list[float] = []
    local_step = 0
    epoch = opt.local_epoch
    try:
        while time.perf_counter() - t0 < args.budget:
            offs = window_offsets(tokens.size, wl.seq_len, wl.seed,
                                  local_step * args.world + args.rank, share)
            win = torch.from_numpy(tokens[offs[:, None] + np.arange(wl.seq_len + 1)[None, :]])
            loss = lm_loss(model(win[:, :-1]), win[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            pending.append(float(loss.detach()))
            local_step += 1
            t = time.perf_counter() - t0
            if args.rank == 0 and clock.due(t):
                save_snapshot(args.snapshot_dir, snaps, t, local_step - 1, model.state_dict())
                snaps += 1
            if opt.local_epoch != epoch:
                epoch = opt.local_epoch
                events.append((time.perf_counter() - t0, epoch - 1,
                               sum(pending) / len(pending),
                               epoch * args.epoch_batches * wl.tokens_per_step))
                pending.clear()
    finally:
        if args.rank == 0:
            save_snapshot(args.snapshot_dir, snaps, time.perf_counter() - t0,
                          max(0, local_step - 1), model.state_dict())
            Path(args.out).write_text(Trace("hivemind", events, {
                "epoch_batches": args.epoch_batches, "use_local_updates": True,
                "startup_s": startup_s,
                "world": args.world, "local_steps": local_step,
                "matchmaking_time": args.matchmaking_time}).to_json())
        opt.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
