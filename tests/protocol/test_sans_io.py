"""protocol/ must stay sans-IO: no asyncio, aiohttp, socket or torch, directly or transitively."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FORBIDDEN = ("asyncio", "aiohttp", "socket", "torch", "uvloop", "ssl")


def test_protocol_imports_no_io_modules() -> None:
    root = Path(__file__).resolve().parents[2]
    mods = sorted(
        "protocol." + p.stem if p.stem != "__init__" else "protocol"
        for p in (root / "protocol").glob("*.py")
    )
    code = (
        "import sys, json\n"
        f"for m in {mods!r}: __import__(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert not bad, f"protocol/ pulled in I/O modules: {bad}"
