"""What /metrics adds beyond the live figures: the client library's process and platform
collectors, `fusion_build_info`, the counters of the jobs coordinated here (outcomes,
restarts, a step-duration histogram), with an ended job's figures kept long enough for an
alert to fire on it, the checkpoints' ages; and the counters of events a cluster's operator
watches for, each moved by a real event on loopback: a reconnect, a TLS refusal, a refused
join, a failed probe."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fusiond
from fusiond.cluster import ClusterView
from fusiond.cluster.probes import LinkProber, ProbeConfig, ProbeFailed
from fusiond.jobs.metrics import KEEP_ENDED_S, JobCollector, JobStats
from fusiond.metrics import DaemonCollector, make_registry
from fusiond.net import (
    JoinAuthority,
    JoinFailed,
    NetConfig,
    PeerNetwork,
    PeerUnreachable,
    TLSMaterial,
    init_cluster,
    join_cluster,
    make_join_token,
)
from fusiond.net.pki import (
    create_cluster_ca,
    issue_node_certificate,
    load_or_create_node_identity,
    store_node_credentials,
)
from protocol.frames import Buffer
from protocol.messages import Message, Ping


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


class Coord:
    def __init__(self, job: str) -> None:
        self.job = job

    def status(self) -> dict[str, Any]:
        return {"job_id": self.job, "state": "running", "steps": 10, "step": 3, "loss": 2.5,
                "held_out_loss": 2.75, "held_out_step": 2,
                "tokens_per_s": 100.0, "samples_per_s": None, "edges": [],
                "stages": [{"stage": 0, "node": "n1", "busy": 0.5, "wait": 0.1}]}


def test_build_info_and_the_process_collectors() -> None:
    got = _samples(generate_latest(make_registry()).decode())
    [info] = [k for k in got if k[0] == "fusion_build_info"]
    assert dict(info[1])["version"] == fusiond.__version__ and got[info] == 1.0
    names = {k[0] for k in got}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_info",
            "python_gc_collections_total"} <= names


def test_job_outcomes_restarts_step_times_and_ended_jobs_that_stay_a_while() -> None:
    now = [1000.0]
    stats = JobStats(clock=lambda: now[0])
    running: list[Coord] = [Coord("a"), Coord("b")]
    reg = make_registry(JobCollector(lambda: list(running), stats), process=False)
    for wall in (0.004, 0.03, 0.03, 7.0, 1e4):
        stats.step(wall)
    stats.step(float("nan"))  # not a duration: not counted
    stats.restarted()
    ended = Coord("b").status()
    running.pop()
    stats.ended("b", "failed", ended)
    got = _samples(generate_latest(reg).decode())
    assert got[("fusion_job_outcomes_total", (("outcome", "failed"),))] == 1.0
    assert got[("fusion_job_outcomes_total", (("outcome", "done"),))] == 0.0
    assert got[("fusion_job_restarts_total", ())] == 1.0
    h = "fusion_job_step_duration_seconds"
    assert got[(f"{h}_bucket", (("le", "0.01"),))] == 1.0
    assert got[(f"{h}_bucket", (("le", "0.05"),))] == 3.0
    assert got[(f"{h}_bucket", (("le", "10.0"),))] == 4.0
    assert got[(f"{h}_bucket", (("le", "+Inf"),))] == 5.0 == got[(f"{h}_count", ())]
    assert abs(got[(f"{h}_sum", ())] - 10007.064) < 1e-6
    # the failed job is still there, with its last figures, for an alert to see
    assert got[("fusion_job_state", (("job", "a"), ("state", "running")))] == 1.0
    assert got[("fusion_job_state", (("job", "b"), ("state", "failed")))] == 1.0
    assert got[("fusion_job_loss", (("job", "b"),))] == 2.5
    assert got[("fusion_job_heldout_loss", (("job", "b"),))] == 2.75
    now[0] += KEEP_ENDED_S + 1
    got = _samples(generate_latest(reg).decode())
    assert ("fusion_job_state", (("job", "b"), ("state", "failed"))) not in got
    assert got[("fusion_job_outcomes_total", (("outcome", "failed"),))] == 1.0  # a counter


def test_checkpoint_age_of_running_jobs() -> None:
    now = [5000.0]
    at: dict[str, float | None] = {"a": 4990.0, "b": None, "gone": 1.0}
    reg = make_registry(JobCollector(lambda: [Coord("a"), Coord("b")], JobStats(),
                                     checkpoints=lambda: at, clock=lambda: now[0]),
                        process=False)
    got = _samples(generate_latest(reg).decode())
    age = "fusion_job_checkpoint_age_seconds"
    assert got[(age, (("job", "a"),))] == 10.0
    # No checkpoint yet, or not running here: no age.
    assert {k for k in got if k[0] == age} == {(age, (("job", "a"),))}
    now[0] += 30
    assert _samples(generate_latest(reg).decode())[(age, (("job", "a"),))] == 40.0


# -- the cluster's counters, each moved by a real event ------------------------------------

FAST = NetConfig(connect_timeout_s=2.0, handshake_timeout_s=2.0, backoff_initial_s=0.02,
                 backoff_max_s=0.2, close_timeout_s=1.0)


async def _quiet(peer: str, msg: Message) -> None:
    """A handler that takes everything."""


@pytest.fixture
async def nets() -> AsyncIterator[list[PeerNetwork]]:
    """PeerNetworks a test starts (`_start`); all closed at teardown."""
    out: list[PeerNetwork] = []
    yield out
    for n in out:
        await n.close()


async def _start(nets: list[PeerNetwork], node_id: str, cluster_id: str = "c-test",
                 tls: TLSMaterial | None = None, port: int = 0, **kw: Any) -> PeerNetwork:
    net = PeerNetwork(node_id=node_id, cluster_id=cluster_id, listen=("127.0.0.1", port),
                      tls=tls, handler=_quiet, config=FAST, **kw)
    nets.append(net)
    await net.start()
    return net


def _scrape(net: PeerNetwork, prober: LinkProber | None = None
            ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics of a daemon whose transport is `net` (and whose cluster probes with `prober`)."""
    view = ClusterView(net.node_id, net.cluster_id, (), None, 0, False, 0, 0, 1)
    col = DaemonCollector(node_id=lambda: net.node_id, net_stats=net.stats,
                          cluster_view=lambda: view, started_at=0.0, net_counts=net.counts,
                          probe_failures=lambda: prober.failures if prober else None)
    return _samples(generate_latest(make_registry(col, process=False)).decode())


async def _until(cond: Any, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_reconnects_count_a_link_dialled_again(nets: list[PeerNetwork]) -> None:
    a = await _start(nets, "a")
    b = await _start(nets, "b")
    port = b.address[1]
    await a.connect(b.address)
    key = ("fusion_net_reconnects_total", (("peer", "b"),))
    assert _scrape(a)[key] == 0.0
    await b.close()  # b restarts on its port: a's link goes and is dialled again
    await _until(lambda: not a.stats()["b"].connected)
    nets.append(b2 := PeerNetwork(node_id="b", cluster_id="c-test", listen=("127.0.0.1", port),
                                  tls=None, handler=_quiet, config=FAST))
    await b2.start()

    async def resend() -> None:
        while a.stats()["b"].reconnects == 0:
            await a.send("b", Ping(request_id=1, sent_at=0.0))
            await asyncio.sleep(0.05)

    await asyncio.wait_for(resend(), 5.0)
    assert _scrape(a)[key] == 1.0


def _node(root: Path, name: str, ca: Any) -> tuple[str, TLSMaterial]:
    ident = load_or_create_node_identity(root / name)
    cert = issue_node_certificate(ca, ident.key.public_key())
    return ident.node_id, store_node_credentials(root / name, cert, ca.cert)


async def test_tls_refusals_count_a_certificate_of_another_cluster(
    tmp_path: Path, nets: list[PeerNetwork]
) -> None:
    ours, theirs = create_cluster_ca(tmp_path / "ours"), create_cluster_ca(tmp_path / "theirs")
    idb, mb = _node(tmp_path / "ours", "b", ours)
    idx, mx = _node(tmp_path / "theirs", "x", theirs)
    b = await _start(nets, idb, ours.cluster_id, mb)
    x = await _start(nets, idx, ours.cluster_id, mx)  # the right cluster id, a wrong CA
    key = ("fusion_net_tls_refusals_total", (("check", "handshake"),))
    assert _scrape(b)[key] == 0.0
    with pytest.raises(PeerUnreachable):
        await x.connect(b.address)
    await _until(lambda: _scrape(b)[key] == 1.0)
    assert _scrape(x)[key] == 1.0  # the dialer refused b's certificate too
    assert _scrape(b)[("fusion_net_tls_refusals_total", (("check", "identity"),))] == 0.0


async def test_join_refusals_count_a_bad_token_by_reason(
    tmp_path: Path, nets: list[PeerNetwork]
) -> None:
    ca, ident, material = init_cluster(tmp_path / "m")
    m = await _start(nets, ident.node_id, ca.cluster_id, material,
                     join_authority=JoinAuthority(ca, tmp_path / "m"))
    expired = make_join_token(ca, [m.address], ttl_s=1, now=time.time() - 10)
    other, _, _ = init_cluster(tmp_path / "other")
    with pytest.raises(JoinFailed, match="expired"):
        await join_cluster(expired, tmp_path / "j1", timeout_s=5)
    with pytest.raises(JoinFailed, match="bad proof"):
        await join_cluster(make_join_token(other, [m.address]), tmp_path / "j2", timeout_s=5)
    got = _scrape(m)
    name = "fusion_cluster_join_refusals_total"
    assert {dict(k[1])["reason"]: v for k, v in got.items() if k[0] == name} == {
        "expired": 1.0, "invalid": 1.0, "used": 0.0, "malformed": 0.0, "error": 0.0}


async def test_probe_failures_count_a_peer_that_does_not_answer(
    nets: list[PeerNetwork]
) -> None:
    a = await _start(nets, "a")

    async def nowhere(peer: str, msg: Message, payload: Sequence[Buffer] = ()) -> None:
        """A link that loses everything: no Pong ever comes back."""

    prober = LinkProber(send=nowhere, config=ProbeConfig(repeats=1, timeout_s=0.05))
    key = ("fusion_cluster_probe_failures_total", (("peer", "ghost"),))
    assert key not in _scrape(a, prober)
    with pytest.raises(ProbeFailed):
        await prober.probe("ghost")
    assert _scrape(a, prober)[key] == 1.0
