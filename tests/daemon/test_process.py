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


@pytest.mark.timeout(60)
def test_logs_speak_journald_under_systemd_and_json_lines_when_asked(root: Path) -> None:
    """Under systemd (stderr is the journal: $JOURNAL_STREAM names it) each line carries its
    syslog priority and no timestamp of its own, so `journalctl -p warning` filters and the
    time is not printed twice; `log_format = "json"` writes one JSON object per line. (Every
    line used to be `time LEVEL logger: message`.)"""
    import json

    node = _node(root, net={"listen": "127.0.0.1:0", "insecure_plaintext": True},
                 cluster={"mdns": False, "probes": False})
    node.dir.mkdir(parents=True, exist_ok=True)
    node.log_path.touch()
    st = node.log_path.stat()
    node.start({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    try:
        ok, _, _ = wait_until(lambda: ((node.status(1.0) or {}).get("node", {}).get("phase")
                                       == "running", ""), 30)
        assert ok, node.log_text()
    finally:
        assert node.stop() == 0
    lines = [ln for ln in node.log_text().splitlines() if ln.startswith("<")]
    assert any(ln.startswith("<4>fusiond: PLAINTEXT peer links") for ln in lines), lines
    assert any(ln.startswith("<6>fusiond: ready:") for ln in lines), lines
    assert not any(ln[3:7].isdigit() for ln in lines)  # no timestamp: journald adds its own

    root2 = root / "json"
    node = _node(root2, log_format="json", net={"listen": "127.0.0.1:0",
                                                "insecure_plaintext": True},
                 cluster={"mdns": False, "probes": False})
    node.start()
    try:
        ok, _, _ = wait_until(lambda: ((node.status(1.0) or {}).get("node", {}).get("phase")
                                       == "running", ""), 30)
        assert ok, node.log_text()
    finally:
        assert node.stop() == 0
    records = [json.loads(ln) for ln in node.log_text().splitlines() if ln.startswith("{")]
    assert records and all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)
    assert any(r["level"] == "warning" and "PLAINTEXT" in r["msg"] for r in records)
    assert any(r["msg"].startswith("ready:") for r in records)


def test_journal_lines_keep_a_tracebacks_priority() -> None:
    import logging

    from fusiond.daemon import JournalFormatter, journal_stream

    try:
        raise ValueError("boom")
    except ValueError:
        import sys as _sys

        rec = logging.LogRecord("fusiond.api", logging.ERROR, __file__, 1, "API %s failed",
                                ("GET /x",), _sys.exc_info())
    text = JournalFormatter().format(rec)
    assert text.splitlines()[0] == "<3>fusiond.api: API GET /x failed"
    assert all(ln.startswith("<3>") for ln in text.splitlines()) and "ValueError: boom" in text
    assert not journal_stream({"JOURNAL_STREAM": "1:2"})  # not our stderr
