"""Redraw the plots of docs/benchmarks.md from the raw traces `bench/wan.py` committed
(`docs/wan-traces/<topology>-<regime>.json`): per topology and regime, the held-out loss of
every system against wall-clock and against step, with the target.

    .venv/bin/python bench/wan_plot.py [--traces docs/wan-traces] [--out docs]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.wan_common import LABELS  # noqa: E402


def redraw(traces: Path, out: Path) -> list[Path]:
    """One PNG per trace file (`benchmarks-<topology>-<regime>.png` under `out`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for path in sorted(traces.glob("*.json")):
        doc = json.loads(path.read_text())
        fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for run in doc["runs"]:
            pts = run.get("heldout") or []
            if not pts:
                continue
            label = LABELS.get(run["system"], run["system"])
            ax_t.plot([p[0] for p in pts], [p[2] for p in pts], marker=".", linewidth=1,
                      label=label)
            ax_s.plot([p[1] for p in pts], [p[2] for p in pts], marker=".", linewidth=1,
                      label=label)
        for ax in (ax_t, ax_s):
            ax.axhline(float(doc["target_loss"]), color="grey", linestyle=":", linewidth=1)
        ax_t.set_xlabel("wall-clock (s)")
        ax_s.set_xlabel("optimizer step")
        ax_t.set_ylabel("held-out loss (dense weights)")
        fig.suptitle(f"{doc['topology']}, {doc['regime']}")
        ax_s.legend(fontsize=7)
        fig.tight_layout()
        png = out / f"benchmarks-{doc['topology']}-{doc['regime']}.png"
        fig.savefig(png, dpi=100)
        plt.close(fig)
        written.append(png)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--traces", type=Path, default=REPO / "docs" / "wan-traces")
    ap.add_argument("--out", type=Path, default=REPO / "docs")
    args = ap.parse_args()
    for png in redraw(args.traces, args.out):
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
