"""PeerNetwork on loopback: handshake, lanes, refusals, garbage, backpressure, reconnect."""

from __future__ import annotations

from fusiond.net import PeerNetwork
from protocol.messages import Ping, Pong
from tests.net.conftest import Inbox, NetFactory


async def test_handshake_and_exchange(net_factory: NetFactory) -> None:
    ia, ib = Inbox(), Inbox()
    a = await net_factory("a", handler=ia)
    b = await net_factory("b", handler=ib)
    assert await a.connect(b.address) == "b"
    await a.send("b", Ping(request_id=1, sent_at=1.5))
    (peer, msg), = await ib.wait_for(1)
    assert peer == "a" and msg == Ping(request_id=1, sent_at=1.5)
    # b learned a's listen address from Hello and can answer without being told.
    await b.send("a", Pong(request_id=1, sent_at=1.5))
    (peer, msg), = await ia.wait_for(1)
    assert peer == "b" and isinstance(msg, Pong)
    sa, sb = a.stats()["b"], b.stats()["a"]
    assert sa.connected and sa.frames_sent == 1 and sa.bytes_sent > 0
    assert sb.frames_received == 1 and sb.bytes_received >= sa.bytes_sent
    assert isinstance(a, PeerNetwork) and a.plaintext
