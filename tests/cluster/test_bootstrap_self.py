"""A bootstrap address that turns out to be this node itself (its own join token's address)
is dropped at once: before, the dialler retried it forever, and a node alone that still dials
a bootstrap address never founds its cluster, so `init` then `join` with its own token left it
without a scheduler."""

from __future__ import annotations

import asyncio

from fusiond.cluster.discovery import BootstrapDialer
from fusiond.errors import SelfAddress

Address = tuple[str, int]


async def test_a_bootstrap_address_of_this_node_itself_is_not_dialled_again() -> None:
    dials: list[Address] = []
    found: list[str] = []

    async def connect(address: Address) -> str:
        dials.append(address)
        raise SelfAddress(f"{address[0]}:{address[1]} is this node itself")

    dialer = BootstrapDialer(connect=connect, on_found=lambda p, a, s: found.append(p),
                             retry_s=0.01)
    try:
        dialer.add(("127.0.0.1", 7420))
        await asyncio.sleep(0.2)  # twenty retry periods
        assert dials == [("127.0.0.1", 7420)]
        assert dialer.pending() == [] and found == []
        dialer.add(("127.0.0.1", 7420))  # added again (a second join): still not dialled
        await asyncio.sleep(0.05)
        assert len(dials) == 1
    finally:
        await dialer.close()
