"""The GPU check (bench/gpu.py, scripts/gpu-check) has no GPU to run on here: its smoke run
(`--device cpu`) runs every part but the `gpu` tests on the CPU, the 3-daemon cluster
included, so a renamed API or a wrong CLI flag fails in CI, not on the day a GPU is lent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multidaemon, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_end_to_end_on_the_cpu() -> None:
    out = subprocess.run(
        [sys.executable, "bench/gpu.py", "--device", "cpu", "--size", "tiny", "--batch", "2",
         "--seq", "32", "--repeats", "1", "--steps", "6"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "fp32 on cpu, 4 partition(s) vs eager" in text and "FAIL" not in text, text[-3000:]
    assert "3-daemon cluster, bf16, loss first/last 5" in text
    assert "samples/s: cluster / one process bf16" in text
