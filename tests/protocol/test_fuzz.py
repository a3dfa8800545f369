"""Robustness of the frame decoder and message parsing against hostile input, and a fuzz target.

Invariants checked on every input:
- only `ProtocolError` subclasses escape (never IndexError, struct.error, RecursionError, ...);
- the decoder never holds more than the configured limits;
- anything accepted as a message re-encodes, and re-decodes to the same header bytes.

`test_fuzz_frames_and_messages` is marked `fuzz`: it runs hypothesis for a bounded time
(FUSION_FUZZ_SECONDS, default 20) over the same target, with fresh random inputs each run.
"""

from __future__ import annotations

import os
import random
import time
import tracemalloc
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import ProtocolError
from protocol.frames import FIXED_HEADER_SIZE, Frame, FrameDecoder, encode_frame, frame_bytes
from protocol.limits import Limits
from protocol.messages import MESSAGE_TYPES, Message, decode_message, encode_header, encode_message
from tests.protocol.test_messages import KINDS, any_message, msgpack_values, sample

LIMITS = Limits(
    max_frame_bytes=1 << 16,
    max_header_bytes=1 << 12,
    max_string_bytes=256,
    max_list_items=64,
)
"""Small limits, so that the fuzzer reaches every limit check."""
MAX_HELD = FIXED_HEADER_SIZE + LIMITS.max_header_bytes + LIMITS.max_frame_bytes


def target(data: bytes, cuts: list[int]) -> list[Message]:
    """The fuzz target: feed `data` in the chunking `cuts`, parse every frame it yields."""
    # An odd first cut drives the BufferedProtocol API (get_buffer/buffer_updated) instead.
    buffered = bool(cuts) and cuts[0] % 2 == 1
    dec = FrameDecoder(LIMITS, direct_bytes=16, scratch_bytes=64)
    out: list[Message] = []
    last = 0
    try:
        for p in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
            if buffered:
                got: list[Frame] = []
                while last < p:
                    buf = dec.get_buffer(-1)
                    n = min(len(buf), p - last)
                    buf[:n] = data[last : last + n]
                    last += n
                    got += dec.buffer_updated(n)
            else:
                got = dec.feed(data[last:p])
            for frame in got:
                msg = decode_message(frame, LIMITS)
                assert type(msg) is MESSAGE_TYPES[frame.msg_type]
                header = encode_header(msg, LIMITS)
                [again] = FrameDecoder(LIMITS).feed(
                    frame_bytes(encode_message(msg, [frame.payload], limits=LIMITS))
                )
                assert encode_header(decode_message(again, LIMITS), LIMITS) == header
                out.append(msg)
            last = p
            assert dec.buffered <= MAX_HELD
    except ProtocolError:
        pass
    return out


def mutate(data: bytes, rnd: random.Random) -> bytes:
    """A few random edits of the kinds a broken or hostile peer produces."""
    b = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(6)
        if op == 0 and b:  # bit flip
            i = rnd.randrange(len(b))
            b[i] ^= 1 << rnd.randrange(8)
        elif op == 1:  # insert random bytes
            i = rnd.randint(0, len(b))
            b[i:i] = rnd.randbytes(rnd.randint(1, 8))
        elif op == 2 and b:  # delete a run
            i = rnd.randrange(len(b))
            del b[i : i + rnd.randint(1, 8)]
        elif op == 3:  # truncate
            del b[rnd.randint(0, len(b)) :]
        elif op == 4 and len(b) >= FIXED_HEADER_SIZE:  # absurd length fields
            off = rnd.choice([8, 16])
            size = 4 if off == 8 else 8
            b[off : off + size] = rnd.choice([0, 1, (1 << (8 * size)) - 1, 1 << 31]).to_bytes(
                size, "little"
            )
        elif op == 5:  # duplicate a slice (splices frames into each other)
            i = rnd.randint(0, len(b))
            j = rnd.randint(i, len(b))
            b[i:i] = b[i:j]
    return bytes(b)


def valid_stream(msgs: list[Message], payloads: list[bytes]) -> bytes:
    return b"".join(
        frame_bytes(encode_message(m, [p], limits=LIMITS)) for m, p in zip(msgs, payloads)
    )


small_messages = any_message.filter(lambda m: len(encode_header(m)) < LIMITS.max_header_bytes // 2)


# --- robustness (fast, always run) -----------------------------------------------------------


@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(0, 600), max_size=6))
@settings(max_examples=200, deadline=None)
def test_random_bytes(data: bytes, cuts: list[int]) -> None:
    target(data, cuts)


@given(
    msgs=st.lists(small_messages, min_size=1, max_size=3),
    seed=st.integers(0, 2**32),
    cuts=st.lists(st.integers(0, 5000), max_size=6),
)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
def test_mutated_valid_streams(msgs: list[Message], seed: int, cuts: list[int]) -> None:
    rnd = random.Random(seed)
    stream = valid_stream(msgs, [rnd.randbytes(rnd.randint(0, 40)) for _ in msgs])
    assert len(target(stream, cuts)) == len(msgs)  # the unmutated stream decodes fully
    target(mutate(stream, rnd), cuts)


@given(
    type_id=st.sampled_from(sorted(MESSAGE_TYPES)),
    header=msgpack_values,
)
@settings(max_examples=200, deadline=None)
def test_arbitrary_msgpack_headers(type_id: int, header: Any) -> None:
    """Well-formed frames whose header is any msgpack value: wrong types, shapes, nesting."""
    raw = msgpack.packb(header, use_bin_type=True)
    if len(raw) <= LIMITS.max_header_bytes:
        target(frame_bytes(encode_frame(type_id, raw, limits=LIMITS)), [])


@given(
    cls=st.sampled_from(KINDS),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_one_field_replaced_by_a_random_value(cls: type[Message], data: st.DataObject) -> None:
    """A valid header with one field, at any nesting depth, replaced by any msgpack value."""
    wire: Any = sample(cls).to_wire()
    node = wire
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = data.draw(st.sampled_from(keys))
        if isinstance(node[key], dict | list) and node[key] and data.draw(st.booleans()):
            node = node[key]
            continue
        node[key] = data.draw(msgpack_values)
        break
    raw = msgpack.packb(wire, use_bin_type=True)
    if len(raw) <= LIMITS.max_header_bytes:
        target(frame_bytes(encode_frame(cls.TYPE_ID, raw, limits=LIMITS)), [])


@pytest.mark.parametrize(
    "header",
    [
        b"\xdf\xff\xff\xff\xff",  # map of 2^32-1 entries, in 5 bytes
        b"\xdd\xff\xff\xff\xff",  # array of 2^32-1 items
        b"\xdb\xff\xff\xff\xff",  # str of 4 GiB
        b"\xc6\xff\xff\xff\xff",  # bin of 4 GiB
        b"\xc9\xff\xff\xff\xff\x05",  # ext of 4 GiB
        b"\x91" * 3000 + b"\xc0",  # 3000-deep nesting
        b"\x81\xa7members" + b"\xdd\x00\x00\x10\x00" + b"\x80" * 10,  # 4096 declared, 10 there
    ],
)
def test_declared_sizes_never_allocate(header: bytes) -> None:
    tracemalloc.start()
    try:
        for type_id in (6, 12, 17):
            target(frame_bytes(encode_frame(type_id, header, limits=LIMITS)), [])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20


# --- the bounded-time fuzz target ------------------------------------------------------------


@st.composite
def fuzz_input(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    kind = draw(st.integers(0, 3))
    cuts = draw(st.lists(st.integers(0, 1 << 14), max_size=8))
    if kind == 0:
        return draw(st.binary(max_size=2000)), cuts
    msgs = draw(st.lists(small_messages, min_size=1, max_size=4))
    payloads = [draw(st.binary(max_size=100)) for _ in msgs]
    stream = valid_stream(msgs, payloads)
    if kind == 1:
        return stream, cuts
    rnd = random.Random(draw(st.integers(0, 2**32)))
    if kind == 2:
        return mutate(stream, rnd), cuts
    # A valid frame around a mutated msgpack header: reaches message parsing, which frame
    # checks would otherwise stop first.
    header = mutate(encode_header(msgs[0], LIMITS), rnd)[: LIMITS.max_header_bytes]
    return frame_bytes(encode_frame(msgs[0].TYPE_ID, header, limits=LIMITS)), cuts


@pytest.mark.fuzz
def test_fuzz_frames_and_messages() -> None:
    """Half the time budget: hypothesis inputs; half: a fast mutational loop over a corpus."""
    seconds = float(os.environ.get("FUSION_FUZZ_SECONDS", "20"))
    half = time.monotonic() + seconds / 2
    runs = 0

    @given(fuzz_input())
    @settings(
        max_examples=100,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def batch(inp: tuple[bytes, list[int]]) -> None:
        nonlocal runs
        runs += 1
        target(*inp)

    while time.monotonic() < half:
        batch()  # each call draws fresh random inputs

    seed = int(os.environ.get("FUSION_FUZZ_SEED", time.time_ns() % 2**32))
    rnd = random.Random(seed)
    corpus = [valid_stream([sample(cls)], [rnd.randbytes(rnd.randint(0, 64))]) for cls in KINDS]
    headers = [(cls.TYPE_ID, encode_header(sample(cls), LIMITS)) for cls in KINDS]
    mutated = 0
    deadline = half + seconds / 2
    while time.monotonic() < deadline:
        if rnd.random() < 0.5:
            data = mutate(b"".join(rnd.sample(corpus, rnd.randint(1, 3))), rnd)
        else:
            type_id, header = rnd.choice(headers)
            header = mutate(header, rnd)[: LIMITS.max_header_bytes]
            data = frame_bytes(encode_frame(type_id, header, limits=LIMITS))
        cuts = [rnd.randrange(len(data) + 1) for _ in range(rnd.randint(0, 4))]
        try:
            target(data, cuts)
        except BaseException:
            print(f"fuzz failure: FUSION_FUZZ_SEED={seed}, input {data!r}, cuts {cuts}")
            raise
        mutated += 1
    assert runs > 0 and mutated > 0
    print(f"fuzzed {runs} hypothesis inputs and {mutated} mutations (seed {seed})")
