"""Fixtures for fusiond.net tests: every async test runs under asyncio's loop and uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from fusiond.net import NetConfig, PeerNetwork, TLSMaterial
from fusiond.net.pki import (
    ClusterCA,
    create_cluster_ca,
    issue_node_certificate,
    load_or_create_node_identity,
    store_node_credentials,
)
from protocol.messages import Message

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency where the platform has it
    uvloop = None


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Any]:
    """pytest-asyncio 1.x hook: parametrize this directory's async tests over both loops."""
    factories: dict[str, Any] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


FAST = NetConfig(
    connect_timeout_s=2.0,
    handshake_timeout_s=2.0,
    backoff_initial_s=0.02,
    backoff_max_s=0.2,
    close_timeout_s=1.0,
)


class Inbox:
    """A handler that records (peer, message) pairs and lets tests await them."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Message]] = []
        self._cond = asyncio.Condition()

    async def __call__(self, peer: str, msg: Message) -> None:
        async with self._cond:
            self.items.append((peer, msg))
            self._cond.notify_all()

    async def wait_for(self, n: int, within: float = 5.0) -> list[tuple[str, Message]]:
        async with asyncio.timeout(within), self._cond:
            await self._cond.wait_for(lambda: len(self.items) >= n)
        return self.items


def make_cluster(root: Path) -> ClusterCA:
    return create_cluster_ca(root / "ca")


def make_node(root: Path, ca: ClusterCA, name: str) -> tuple[str, TLSMaterial]:
    """A node state dir under root/name with a key and a certificate from `ca`."""
    d = root / name
    ident = load_or_create_node_identity(d)
    cert = issue_node_certificate(ca, ident.key.public_key())
    return ident.node_id, store_node_credentials(d, cert, ca.cert)


NetFactory = Callable[..., Awaitable[PeerNetwork]]


@pytest.fixture
async def net_factory() -> AsyncIterator[NetFactory]:
    """Start PeerNetworks on 127.0.0.1:0; all are closed at teardown."""
    nets: list[PeerNetwork] = []

    async def make(
        node_id: str,
        cluster_id: str = "c-test",
        *,
        tls: TLSMaterial | None = None,
        handler: Callable[[str, Message], Awaitable[None]] | None = None,
        config: NetConfig = FAST,
        **kw: Any,
    ) -> PeerNetwork:
        net = PeerNetwork(
            node_id=node_id,
            cluster_id=cluster_id,
            listen=("127.0.0.1", 0),
            tls=tls,
            handler=handler or Inbox(),
            config=config,
            **kw,
        )
        nets.append(net)
        await net.start()
        await net.ready()
        return net

    yield make
    for n in nets:
        await n.close()


async def until(pred: Callable[[], object], within: float = 3.0, step: float = 0.005) -> None:
    """Poll `pred` until true; TimeoutError after `within` seconds (for state with no event)."""
    deadline = asyncio.get_running_loop().time() + within
    for _ in range(1 << 30):
        if pred():
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"condition not met within {within} s")
        await asyncio.sleep(step)
