"""The dashboard's server without a browser: who gets in (a session from `POST /v1/dashboard`,
bound to the API caller that asked), what a session sees (that caller's jobs), the live
stream (each loss point once), stale links, and the guards (Host, read-only, static files)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fusiond.api.dashboard import (
    DashboardServer,
    Follower,
    Sessions,
    job_points,
    links_block,
    snapshot,
)
from fusiond.api.server import ApiError, Caller
from tests.daemon.test_daemon import _until

ALICE = Caller("unix", uid=1001, gid=1001, pid=1)
BOB = Caller("unix", uid=1002, gid=1002, pid=2)


class FakeBackend:
    """The API's answers for two users' jobs; records who asked for what."""

    def __init__(self) -> None:
        self.steps = {"a-1": 5, "b-1": 3}
        self.owner = {"a-1": 1001, "b-1": 1002}
        self.asked: list[tuple[str, int | None]] = []
        self.rewound = False

    def status(self) -> dict[str, Any]:
        prof = {"labels": {"name": "alpha"}, "device_kind": "cpu"}
        return {"node": {"node_id": "n1", "name": "alpha", "phase": "running"},
                "cluster": {"leader": "n1", "term": 3, "has_quorum": True, "voters": 2,
                            "alive_voters": 1, "needed": 2, "members": [
                                {"node_id": "n1", "state": "alive", "role": "scheduler",
                                 "address": ["127.0.0.1", 1], "profile": prof},
                                {"node_id": "n2", "state": "dead", "role": "worker",
                                 "address": ["127.0.0.1", 2],
                                 "profile": {"labels": {"name": "beta"}}}]}}

    def links(self) -> dict[str, Any]:
        lk = {"bandwidth_bits_per_s": 1e9, "rtt_s": 1e-3, "age_s": 1.0,
              "bandwidth_spread_ratio": 0.1}
        return {"links": {"n1": {"n2": lk}, "n2": {"n1": lk}}}

    async def cluster_jobs(self, caller: Caller) -> dict[str, Any]:
        data = self.list_jobs(caller)
        data["cluster"] = {"scheduler": "n1", "jobs": [
            {"job_id": "r-1", "state": "running", "step": 4, "submitted_at": 0.5,
             "submitter": "n2"}]} if caller.operator else None
        return data

    async def remote_job(self, job_id: str, history: int, caller: Caller, *,
                         cancel: bool = False) -> dict[str, Any]:
        self.asked.append(("remote " + job_id, caller.uid))
        hist = [{"step": s, "loss": 4.0 - s / 10} for s in range(4)]
        return {"job_id": job_id, "state": "running", "steps": 10, "step": 4,
                "history": hist[-history:] if history else [], "submitter": "n2",
                "status": {"stages": [], "edges": []}}

    def list_jobs(self, caller: Caller) -> dict[str, Any]:
        self.asked.append(("list", caller.uid))
        mine = [j for j in self.steps if caller.operator or self.owner[j] == caller.uid]
        return {"jobs": [{"job_id": j, "state": "running", "step": self.steps[j],
                          "submitted_at": 1.0} for j in mine],
                "hidden": len(self.steps) - len(mine), "stages": []}

    def job(self, job_id: str, history: int, caller: Caller) -> dict[str, Any]:
        self.asked.append((job_id, caller.uid))
        if not caller.operator and self.owner[job_id] != caller.uid:
            raise ApiError(403, "forbidden", "not yours")
        n = self.steps[job_id]
        hist = [{"step": s, "loss": 5.0 - s / 10, "wall_s": 0.1} for s in range(n)]
        if self.rewound:
            hist = hist[:2]
        return {"job_id": job_id, "name": job_id, "state": "running", "steps": 100,
                "step": n, "history": hist[-history:] if history else [],
                "status": {"stages": [{"stage": 0, "node": "n1", "busy": 0.5, "wait": 0.2}],
                           "edges": []},
                "plan_summary": {"method": "op-fence", "iteration_s": 0.05, "stages": [
                    {"stage": 0, "machine_id": "n1", "start_op": 0, "stop_op": 9,
                     "first_op": "a", "last_op": "b", "compute_s": 0.01, "memory_bytes": 1,
                     "replica_machine_ids": ["n2"], "micro_batches": [2, 2],
                     "recompute": True}]},
                "restarts": 1, "checkpoint_step": 3, "checkpoint_at": 100.0}


def test_sessions_expire_are_bounded_and_never_match_a_wrong_token() -> None:
    now = [0.0]
    s = Sessions(10.0, max_sessions=3, clock=lambda: now[0])
    tokens = [s.mint(ALICE) for _ in range(4)]
    assert len(s) == 3 and s.get(tokens[0]) is None  # the oldest went first
    got = s.get(tokens[3])
    assert got is not None and got.caller == ALICE
    assert s.get(tokens[3] + "x") is None and s.get("") is None and s.get("x" * 300) is None
    now[0] = 10.0
    assert s.get(tokens[3]) is None


async def test_a_session_sees_what_its_caller_sees() -> None:
    b = FakeBackend()
    snap = await snapshot(b, ALICE, Follower(), stale_after_s=30.0, now=200.0)
    assert [j["job_id"] for j in snap["jobs"]] == ["a-1"] and snap["hidden_jobs"] == 1
    assert {uid for _, uid in b.asked} == {1001}  # every call made as alice, none as operator
    job = snap["jobs"][0]
    assert [p["step"] for p in job["points"]] == [0, 1, 2, 3, 4] and job["reset"]
    assert job["stages"][0]["machine"]["name"] == "alpha"
    assert job["stages"][0]["replicas"][0]["name"] == "beta"
    assert job["stages"][0]["recompute"] is True  # the planner's memory decision, shown
    assert job["predicted_iteration_s"] == 0.05 and job["measured_iteration_s"] == 0.1
    assert job["restarts"] == 1 and job["checkpoint_age_s"] == 100.0
    names = [(m["name"], m["state"]) for m in snap["cluster"]["members"]]
    assert names == [("alpha", "alive"), ("beta", "dead")]
    # the operator: every job, those the scheduler runs for other members too
    op = await snapshot(b, Caller("tcp"), Follower(), stale_after_s=30.0)
    assert op["hidden_jobs"] == 0
    assert [j["job_id"] for j in op["jobs"]] == ["a-1", "b-1", "r-1"]
    [r] = [j for j in op["jobs"] if j["job_id"] == "r-1"]
    assert r["submitter"]["name"] == "beta" and [p["step"] for p in r["points"]] == [0, 1, 2, 3]


async def test_points_are_sent_once_and_again_after_a_restart_redid_steps() -> None:
    b = FakeBackend()
    f = Follower()

    async def fetch(n: int) -> dict[str, Any]:
        return b.job("a-1", n, ALICE)

    brief = {"job_id": "a-1", "step": 5}
    _, pts, reset = await job_points(fetch, brief, f)
    assert len(pts) == 5 and reset
    assert (await job_points(fetch, brief, f))[1:] == ([], False)
    b.steps["a-1"] = 7
    _, pts, reset = await job_points(fetch, {"job_id": "a-1", "step": 7}, f)
    assert [p["step"] for p in pts] == [5, 6] and not reset
    b.rewound = True  # a restart from a checkpoint: the history goes back to step 1
    _, pts, reset = await job_points(fetch, {"job_id": "a-1", "step": 2}, f)
    assert reset and [p["step"] for p in pts] == [0, 1]


def test_links_from_or_to_a_member_not_alive_or_too_old_are_stale() -> None:
    members = [{"node_id": "n1", "state": "alive"}, {"node_id": "n2", "state": "alive"},
               {"node_id": "n3", "state": "dead"}]
    fresh = {"bandwidth_bits_per_s": 1e9, "rtt_s": 1e-3, "age_s": 5.0}
    old = {**fresh, "age_s": 31.0}
    got = links_block({"links": {"n1": {"n2": fresh, "n3": fresh}, "n2": {"n1": old}}},
                      members, stale_after_s=30.0)["cells"]
    assert not got["n1"]["n2"]["stale"]
    assert got["n1"]["n3"]["stale"] and got["n2"]["n1"]["stale"]


@pytest.fixture
async def served() -> AsyncIterator[tuple[DashboardServer, FakeBackend]]:
    b = FakeBackend()
    d = DashboardServer(b, "127.0.0.1", 0, session_ttl_s=60.0, stale_after_s=30.0,
                        interval_s=0.05)
    await d.start()
    try:
        yield d, b
    finally:
        await d.close()
        await d.close()  # idempotent


async def test_every_data_route_needs_a_session(
        served: tuple[DashboardServer, FakeBackend]) -> None:
    d, _ = served
    url = d.url
    assert url is not None
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:  # the page itself holds nothing
            assert r.status == 200 and "fusion" in await r.text()
            assert "script-src 'self'" in r.headers["Content-Security-Policy"]
        for path in ("api/snapshot", "api/events"):
            async with s.get(url + path) as r:
                assert r.status == 401, path
                assert "fusionctl dashboard" in (await r.json())["error"]["message"]
            async with s.get(url + path, headers={"Authorization": "Bearer nope"}) as r:
                assert r.status == 401
        tok = d.session_url(ALICE)["token"]
        auth = {"Authorization": f"Bearer {tok}"}
        async with s.get(url + "api/snapshot", headers=auth) as r:
            assert r.status == 200
            assert [j["job_id"] for j in (await r.json())["jobs"]] == ["a-1"]
        async with s.get(url + "api/snapshot", headers={**auth, "Host": "evil.example:80"}) as r:
            assert r.status == 421  # DNS rebinding: a foreign name resolving to 127.0.0.1
        async with s.post(url + "api/snapshot", headers=auth) as r:
            assert r.status == 405
        for name, status in (("app.js", 200), ("style.css", 200), ("index.html", 404),
                             ("..%2Fdashboard.py", 404)):
            async with s.get(url + "static/" + name) as r:
                assert r.status == status, name
        async with s.get(url + "healthz") as r:
            assert r.status == 200


async def test_the_stream_sends_snapshots_with_only_new_points(
        served: tuple[DashboardServer, FakeBackend]) -> None:
    d, b = served
    tok = d.session_url(ALICE)["token"]
    snaps: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s, s.get(
            f"{d.url}api/events", headers={"Authorization": f"Bearer {tok}"}) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        buf = b""
        async with asyncio.timeout(10):
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    if block.startswith(b"event: snapshot"):
                        snaps.append(json.loads(block.split(b"data: ", 1)[1]))
                        if len(snaps) == 1:
                            b.steps["a-1"] = 8
                if len(snaps) >= 3:
                    break
    pts = [[p["step"] for p in snap["jobs"][0]["points"]] for snap in snaps]
    assert pts[0] == [0, 1, 2, 3, 4]
    assert [s for later in pts[1:] for s in later] == [5, 6, 7]


async def test_a_daemon_mints_sessions_for_its_api_callers(tmp_path: Path) -> None:
    """`POST /v1/dashboard` on the socket: a session bound to the kernel's word for the
    caller (SO_PEERCRED), served on `dashboard.listen`; disabled: 409 saying what to set."""
    from fusiond.config import load_config
    from fusiond.daemon import Daemon

    env = {"FUSION_PROFILE_BENCHMARK": "0", "FUSION_METRICS_LISTEN": "127.0.0.1:0",
           "FUSION_NET_LISTEN": "127.0.0.1:0", "FUSION_CLUSTER_MDNS": "0",
           "FUSION_STATE_DIR": str(tmp_path / "s"), "FUSION_CACHE_DIR": str(tmp_path / "c"),
           "FUSION_API_SOCKET": str(tmp_path / "api.sock"),
           "FUSION_DASHBOARD_LISTEN": "127.0.0.1:0"}
    d = Daemon(load_config(env=env))
    task = asyncio.create_task(d.run())
    try:
        await _until(lambda: d.phase == "unconfigured", 20.0)
        conn = aiohttp.UnixConnector(path=str(tmp_path / "api.sock"))
        async with aiohttp.ClientSession(connector=conn) as s:
            async with s.post("http://fusiond/v1/dashboard") as r:
                got = await r.json()
            async with s.get("http://fusiond/healthz") as r:
                assert r.status == 200
            async with s.get("http://fusiond/v1/paths") as r:
                assert (await r.json())["dashboard"] == got["base_url"]
        session = d.dashboard.sessions.get(got["token"])
        assert session is not None and session.caller.uid == os.getuid()
        assert got["url"] == f"{got['base_url']}#token={got['token']}"
        assert d.metrics is not None and d.metrics.address is not None
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{d.metrics.address[0]}:{d.metrics.address[1]}"
                             "/healthz") as r:
                assert r.status == 200
            async with s.get(got["base_url"] + "api/snapshot",
                             headers={"Authorization": f"Bearer {got['token']}"}) as r:
                snap = await r.json()
        assert snap["cluster"]["node"]["phase"] == "unconfigured"
        assert "fusionctl init" in snap["cluster"]["hint"]
    finally:
        d.request_stop()
        assert await task == 0
    d2 = Daemon(load_config(env={**env, "FUSION_DASHBOARD_LISTEN": ""}))
    with pytest.raises(ApiError) as e:
        d2.dashboard_session(ALICE)
    assert e.value.status == 409 and "dashboard.listen" in e.value.message
