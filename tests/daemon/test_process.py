"""fusiond as a process: SIGTERM exits 0, SIGHUP reloads the log level, a second daemon on the
same socket refuses to start (exit 1), and a bad config exits 78 before binding anything."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusionctl.local import LocalNode, wait_until


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fzp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _node(root: Path, **settings: object) -> LocalNode:
    return LocalNode(0, root, {"profile_benchmark": False, "metrics": {"listen": ""},
                               "dashboard": {"listen": ""},
                               **settings})


@pytest.mark.timeout(60)
def test_sigterm_exits_zero_and_sighup_reloads(root: Path) -> None:
    node = _node(root)
    node.start()
    try:
        ok, _, _ = wait_until(lambda: (node.status(1.0) is not None, ""), 20)
        assert ok, node.log_text()
        node.settings["log_level"] = "debug"
        node.write_config()
        node.signal(signal.SIGHUP)
        ok, _, _ = wait_until(lambda: ("SIGHUP: log_level info -> debug" in node.log_text(),
                                       ""), 10)
        assert ok, node.log_text()
        assert node.alive() and node.status() is not None  # reload, not restart
        # a broken file on reload is reported and the running config kept
        good = node.config_path.read_text()
        node.config_path.write_text(good.replace('log_level = "debug"', 'log_level = "loud"'))
        node.signal(signal.SIGHUP)
        ok, _, _ = wait_until(lambda: ("SIGHUP: config not reloaded" in node.log_text(), ""), 10)
        assert ok, node.log_text()
        assert "log_level = 'loud'" in node.log_text() and node.alive()
        node.config_path.write_text(good)
        # a second daemon on the same socket refuses to start, and says why
        second = subprocess.run(
            [sys.executable, "-m", "fusiond", "--config", str(node.config_path),
             "--state-dir", str(root / "other")],
            capture_output=True, text=True, timeout=30,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert second.returncode == 1
        assert "another fusiond is already serving" in second.stderr
        assert node.status() is not None  # the first one is unharmed
    finally:
        node.signal(signal.SIGTERM)
        time.sleep(0.05)
        node.signal(signal.SIGTERM)  # impatient: a second one must not change the outcome
        code = node.stop(15)
    assert code == 0, node.log_text()
    assert "fusiond stopped cleanly" in node.log_text()


@pytest.mark.timeout(60)
def test_bad_config_exits_78_without_binding(root: Path) -> None:
    node = _node(root)
    node.write_config()
    text = node.config_path.read_text() + '\n[cluster]\ngossip_fanout = "many"\n'
    node.config_path.write_text(text.replace("[api]", "[api]", 1))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "fusiond", "--config", str(node.config_path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 78, r.stderr
    assert "cluster.gossip_fanout" in r.stderr and str(node.config_path) in r.stderr
    assert not Path(node.socket).exists()
    assert time.monotonic() - t0 < 30
