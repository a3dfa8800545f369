"""The edge codec's int8: every element within absmax(block)/254 of its value, 1 byte per element
plus a float32 scale per 256 on the wire, decoded dense by the same decoders as every edge."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusiond.plan.model import INT8_BLOCK_ELEMENTS, int8_wire_bytes
from fusiond.train import codec
from protocol import tensors as wire

BLOCK = wire.DEFAULT_BLOCK_SIZE
DESCRIPTOR_MAX_BYTES = 160
"""The descriptor of an int8 tensor of rank <= 4: head, dims, two sections, padding."""


def _check_bound(x: torch.Tensor, q: torch.Tensor) -> None:
    """|x - q| <= absmax(x's block) / 254 element by element (blocks of 256 of the flat tensor)."""
    flat_x = x.detach().reshape(-1).double()
    flat_q = q.reshape(-1).double()
    n = flat_x.numel()
    pad = -n % BLOCK
    xb = torch.nn.functional.pad(flat_x, (0, pad)).reshape(-1, BLOCK)
    absmax = xb.abs().amax(dim=1).repeat_interleave(BLOCK)[:n]
    err = (flat_x - flat_q).abs()
    # the float32 arithmetic of scale = absmax/127 and q * scale: a few ulps beyond the bound
    assert bool((err <= absmax / 254 * (1 + 1e-5) + 1e-38).all()), float((err - absmax / 254).max())


def test_int8_round_trip_is_within_half_a_step_of_each_block() -> None:
    g = torch.Generator().manual_seed(0)
    # blocks of very different magnitudes: each gets its own scale
    x = torch.randn(8, 32, 32, generator=g) * torch.logspace(-6, 3, 8).reshape(8, 1, 1)
    enc = codec.encode_int8(x)
    assert wire.read_descriptor(enc.payload).encoding is wire.Encoding.INT8
    q = codec.decode_dense(enc.payload)
    assert q.shape == x.shape and q.dtype == x.dtype
    _check_bound(x, q)
    assert not torch.equal(q, x)  # it is lossy
    # tiny blocks keep their relative precision (a global scale would flush them to zero)
    assert torch.allclose(q[0], x[0], rtol=0, atol=float(x[0].abs().max()) / 254 * 1.0001)
    # what decode_any (the forward receiver) makes of it: dense, no top-k indices
    dense, idx = codec.decode_any(enc.payload)
    assert idx is None and torch.equal(dense, q)


def test_int8_wire_size_is_what_the_planner_charges() -> None:
    x = torch.randn(8, 32, 32, generator=torch.Generator().manual_seed(1))
    enc = codec.encode_int8(x)
    n = x.numel()
    assert enc.dense_nbytes == 4 * n
    assert int8_wire_bytes(n) == n + 4 * math.ceil(n / INT8_BLOCK_ELEMENTS)
    assert int8_wire_bytes(n) <= enc.nbytes <= int8_wire_bytes(n) + DESCRIPTOR_MAX_BYTES
    assert 0.2539 <= enc.nbytes / enc.dense_nbytes < 0.26  # (1 + 4/256) / 4 + a descriptor
    assert INT8_BLOCK_ELEMENTS == wire.DEFAULT_BLOCK_SIZE


def test_int8_of_zeros_and_a_partial_last_block() -> None:
    x = torch.zeros(3, 100)  # 300 elements: one whole block and one of 44
    assert torch.equal(codec.decode_dense(codec.encode_int8(x).payload), x)
    y = torch.arange(300, dtype=torch.float32).reshape(3, 100) - 150.0
    _check_bound(y, codec.decode_dense(codec.encode_int8(y).payload))


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 17), min_size=1, max_size=4),
       seed=st.integers(0, 2**32 - 1), log_scale=st.floats(-30, 30))
def test_int8_bound_holds_on_random_shapes(shape: list[int], seed: int,
                                            log_scale: float) -> None:
    rng = np.random.default_rng(seed)
    arr = (rng.standard_normal(shape) * rng.lognormal(0.0, 2.0, shape) * 10.0 ** (log_scale / 3))
    x = torch.from_numpy(arr.astype(np.float32))
    enc = codec.encode_int8(x)
    q = codec.decode_dense(enc.payload)
    assert q.shape == x.shape
    _check_bound(x, q)
    assert enc.nbytes <= int8_wire_bytes(x.numel()) + DESCRIPTOR_MAX_BYTES


def test_a_dense_edge_is_sent_from_the_tensors_own_memory() -> None:
    """The gather list protocol.tensors builds goes to the network as it is (issue 16: the
    codec used to join it into one bytes object, a copy of every activation: 3.5 ms for
    16 MiB here); the joined payload, for in-memory links, decodes to the same tensor."""
    from fusiond.train.remote import NetStageLink
    from fusiond.train.stage import Packet, PacketKind

    x = torch.randn(64, 256)
    enc = codec.encode_dense(x)
    assert np.shares_memory(np.frombuffer(enc.parts[-1], dtype=np.uint8), x.numpy())
    assert enc.nbytes == len(enc.payload) > x.numel() * 4
    assert torch.equal(codec.decode_dense(enc.payload), x)

    sent: list[tuple[object, ...]] = []

    class _Net:
        async def send(self, peer: str, msg: object, payload: tuple[object, ...] = ()) -> None:
            sent.append(tuple(payload))

    link = NetStageLink(_Net(), "job", 1, {1: "n1"})  # type: ignore[arg-type]
    pkt = Packet(PacketKind.FORWARD, 0, 0, "e0", 0, 1, enc.parts)
    asyncio.run(link.send(pkt))
    assert len(sent) == 1 and all(a is b for a, b in zip(sent[0], enc.parts, strict=True))
    assert pkt.nbytes == enc.nbytes and pkt.data() == enc.payload
