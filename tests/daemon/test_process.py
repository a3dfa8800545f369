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


@pytest.mark.timeout(60)
def test_init_refuses_a_join_token_no_other_machine_can_use(root: Path) -> None:
    """A daemon in a network namespace with no route (only loopback), listening on all
    addresses: it would advertise 127.0.0.1, so `fusionctl init` says so and what to set,
    and creates nothing (it used to print a token naming 127.0.0.1:PORT)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip (a network namespace of its own)")
    probe = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", "import socket; from fusiond.config import "
         "DaemonConfig, advertise_address; print(advertise_address(DaemonConfig(), "
         "('0.0.0.0', 7420))[0])"], capture_output=True, text=True, timeout=30)
    if probe.stdout.strip() not in ("127.0.0.1", "::1"):
        pytest.skip(f"this machine's host name resolves to {probe.stdout.strip()!r} even "
                    "without a route: the case needs one resolving to loopback")
    wrapper = root / "python-in-netns"
    wrapper.write_text(f"#!/bin/sh\nexec unshare -n sh -c 'ip link set lo up; exec \"$@\"' "
                       f"- {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    node = _node(root, net={"listen": "0.0.0.0:0"},
                 cluster={"mdns": False, "probes": False})
    node.python = str(wrapper)
    node.start()
    try:
        ok, _, _ = wait_until(lambda: (node.status(1.0) is not None, ""), 30)
        assert ok, node.log_text()
        from fusionctl.client import ApiFailure

        with pytest.raises(ApiFailure) as e:
            node.api("POST", "/v1/init", {})
        assert e.value.status == 409 and e.value.code == "unreachable_address"
        assert "127.0.0.1" in e.value.message and "net.advertise" in e.value.message
        assert not (node.state_dir / "ca.key").exists()  # nothing created
        assert node.status()["node"]["phase"] == "unconfigured"  # type: ignore[index]
    finally:
        node.stop()
