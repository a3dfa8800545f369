"""The dashboard in a real browser: headless Chromium (Debian's /usr/bin/chromium) driven by
Playwright, against three real daemons on loopback training a job.

What a person would see: the members listed by name with the scheduler, the loss curve of a
job submitted on another member gaining points while it trains, its plan (stages with
busy/waiting shares, cut edges with their codecs), and a killed member's row turning red.
Without a session the page says how to get one. Screenshots are kept under
`$FUSION_TEST_ARTIFACTS/dashboard` (default: the test's tmp dir), named by the moment they
show.

Skipped with the reason where Chromium or the playwright package is missing, unless
FUSION_BROWSER_REQUIRED=1 (.ci/run sets it: it installs both).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.harness import Cluster
from tests.e2e.conftest import ctl, start_cluster

pytestmark = [pytest.mark.browser, pytest.mark.multidaemon, pytest.mark.slow,
              pytest.mark.timeout(180)]

CHROMIUM = os.environ.get("FUSION_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
"""The machine's closed network refuses Chromium's background connections: these keep it from
making any (docs/dashboard.md, Testing)."""

JOB = """
[job]
name = "dash"
steps = 100
seed = 0
checkpoint_interval = 30
eval_interval = 20
output = "{out}"
[model]
zoo = "gpt2"
config = {{ size = "tiny" }}
[data]
seq_len = 32
[batch]
size = 8
micro_batches = 4
"""


def _need_browser() -> None:
    required = os.environ.get("FUSION_BROWSER_REQUIRED") == "1"
    why = None
    if not os.access(CHROMIUM, os.X_OK):
        why = (f"no Chromium at {CHROMIUM}: `apt-get install chromium` as root (.ci/run does), "
               "or set FUSION_CHROMIUM")
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            why = "the playwright package is missing: scripts/setup installs it (extra `dev`)"
    if why is not None:
        if required:
            pytest.fail(f"FUSION_BROWSER_REQUIRED=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="fzd"))
    c = start_cluster(root, node_settings={0: {"dashboard": {"listen": "127.0.0.1:0"}}},
                      timers={"suspect_after_s": 1.5, "dead_after_s": 3.0,
                              # probes on (the harness turns them off): the link matrix
                              "probes": True, "probe_interval_s": 2.0, "probe_target_s": 0.05,
                              "probe_repeats": 1, "probe_max_bytes": 4 << 20})
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    base = os.environ.get("FUSION_TEST_ARTIFACTS")
    d = (Path(base) if base else tmp_path) / "dashboard"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _until(page: Any, js: str, arg: Any = None, timeout_s: float = 30.0) -> Any:
    """Poll `js` (a function of `arg`) in the page until it returns something truthy. Not
    `wait_for_function`: that evaluates its predicate with eval, which the page's CSP (rightly)
    forbids; `evaluate` goes through the debugger protocol."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = page.evaluate(js, arg)
        if got or time.monotonic() > deadline:
            return got
        page.wait_for_timeout(100)


def _check_the_job_as_data_and_in_metrics(cluster: Cluster, job_id: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The ended job (no browser needed, the same daemons): `job --json` carries the plan as
    data (stages with machines and op ranges, the prediction), not only its text table; the
    scheduler's /metrics counts its outcome and its steps' durations, and still shows the job
    once it ended (a job's gauges used to vanish with its coordinator, before an alert could
    fire)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    node0 = cluster.nodes[0]
    rc, d, err = ctl(node0, "job", job_id, "--json", capsys=capsys)
    plan = d["plan_summary"]
    assert rc == 0 and plan["iteration_s"] > 0 and plan["stages"], err
    assert all({"machine_id", "start_op", "stop_op", "replica_machine_ids"} <= s.keys()
               for s in plan["stages"])
    leader = (node0.status() or {})["cluster"]["leader"]
    lead = next(n for n in cluster.nodes if n.alive() and cluster.node_id(n) == leader)
    url = lead.api("GET", "/v1/paths")["metrics"]
    with urllib.request.urlopen(url, timeout=10) as r:
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(r.read().decode())
               for s in fam.samples}
    assert got[("fusion_job_outcomes_total", (("outcome", "done"),))] >= 1
    assert got[("fusion_job_step_duration_seconds_count", ())] >= 100
    assert got[("fusion_job_state", (("job", job_id), ("state", "done")))] == 1.0
    assert any(k[0] == "fusion_build_info" for k in got)


def _points(page: Any, job_id: str, line: str = "train") -> int:
    n = page.evaluate("([id, line]) => { const l = document.querySelector(`#loss-${CSS.escape(id)}"
                      " polyline.${line}`); return l ? l.points.numberOfItems : 0; }",
                      [job_id, line])
    return int(n)


def test_dashboard_in_chromium(cluster: Cluster, artifacts: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    _need_browser()
    from playwright.sync_api import sync_playwright

    node0 = cluster.nodes[0]
    rc, session, err = ctl(node0, "dashboard", "--json", capsys=capsys)
    assert rc == 0, err
    url, base = session["url"], session["base_url"]
    ids = {cluster.node_id(n): n for n in cluster.nodes}
    job_file = tmp_path / "job.toml"
    job_file.write_text(JOB.format(out=tmp_path / "out"))

    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1300, "height": 1200})
        try:
            errors: list[str] = []
            page = ctx.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

            # No session: the page holds nothing and says how to get one.
            page.goto(base)
            page.wait_for_selector("#notice:not([hidden])")
            assert "fusionctl dashboard" in page.inner_text("#notice")
            assert page.locator("tr.member").count() == 0
            page.screenshot(path=str(artifacts / "0-no-session.png"))

            # With the session: every member by name, the scheduler marked.
            page.goto(url)
            assert _until(page, "() => document.querySelectorAll('tr.member').length === 3")
            assert "token=" not in page.url  # taken out of the address bar
            names = page.locator("tr.member td:first-child").all_inner_texts()
            assert sorted(n.split(" (")[0] for n in names) == ["node0", "node1", "node2"]
            assert page.locator("tr.member .badge.role-scheduler").count() == 1
            assert page.locator("#live.on").count() == 1
            page.screenshot(path=str(artifacts / "1-members.png"), full_page=True)

            # A job submitted on another member (the operator's dashboard shows every job the
            # scheduler runs): its loss curve gains points while it trains.
            rc, out, err = ctl(cluster.nodes[1], "submit", str(job_file), "--detach",
                               "--json", capsys=capsys)
            assert rc == 0, err
            job_id = out["job_id"]
            page.wait_for_selector(f"#job-{job_id}")
            deadline = time.monotonic() + 60
            first = 0
            while time.monotonic() < deadline and first == 0:
                first = _points(page, job_id)
                page.wait_for_timeout(100)
            assert first > 0, "the loss curve never showed a point"
            assert _until(page, "([id, n]) => { const l = document.querySelector(`#loss-${CSS."
                          "escape(id)} polyline.train`); return l && l.points.numberOfItems > n; }",
                          [job_id, first], timeout_s=60)
            later = _points(page, job_id)
            assert later > first
            card = page.locator(f"#job-{job_id}")
            assert card.locator("table.stages tbody tr").count() >= 2  # the plan's stages
            assert card.locator("table.edges tbody tr").count() >= 1   # its cut edges
            assert card.locator("table.edges td", has_text="exact").count() >= 1
            page.screenshot(path=str(artifacts / "2-training.png"), full_page=True)
            page.wait_for_selector(f"#job-{job_id}[data-state=done]", timeout=90_000)
            assert _points(page, job_id) == 100
            # the held-out curve: the scheduler's evaluations after steps 20, 30 (a
            # checkpoint), 40, 60, 80 and 90, each a point of the second line
            assert _points(page, job_id, "held-out") == 6
            assert "after step" in card.inner_text()  # the checkpoint and its age
            _check_the_job_as_data_and_in_metrics(cluster, job_id, capsys)

            # A member dies: its row turns red.
            leader = (node0.status() or {}).get("cluster", {}).get("leader")
            vid, victim = next((i, n) for i, n in ids.items() if n is not node0 and i != leader)
            page.wait_for_selector(f"td.cell[data-dst='{vid}']:not(.stale)", timeout=30_000)
            victim.kill()
            row = f"tr.member[data-node='{vid}']"
            page.wait_for_selector(f"{row}[data-state=dead]", timeout=30_000)
            color = page.eval_on_selector(f"{row} .badge.state",
                                          "el => getComputedStyle(el).color")
            assert color == "rgb(248, 81, 73)", color
            assert page.locator(f"td.cell.stale[data-dst='{vid}']").count() >= 1
            page.screenshot(path=str(artifacts / "3-dead-member.png"), full_page=True)
            assert not errors, errors
        finally:
            ctx.close()
    print(f"screenshots in {artifacts}")
