"""A whole view (every member's profile and links) grows with the square of the members: it
goes out in parts that each fit the CONTROL lane, each naming every member."""

from __future__ import annotations

import time

from fusiond.cluster.membership import Link, MemberRecord
from fusiond.cluster.service import VIEW_PART_BYTES
from protocol.limits import DEFAULT_LIMITS
from protocol.messages import NodeProfile, encode_message
from tests.cluster.fakes import Swarm

MEMBERS = 96
PROFILE = {"device_kind": "cpu", "device_name": "x86_64", "gflops": 7.7, "threads": 2,
           "plan_flops_matmul": 4.6e10, "plan_flops_conv": 2.1e11, "plan_mem_bw": 1.2e10,
           "plan_op_overhead_s": 4e-6, "plan_wire_s_per_byte": 1.9e-9, "plan_msg_s": 2e-5,
           "torch_version": "2.13.0+cpu", "python_version": "3.11.7", "memory_bytes": 1 << 34}


def _records(ids: list[str]) -> list[MemberRecord]:
    now = time.time()
    return [MemberRecord(i, ("10.0.0.1", 7420 + n), 3, 1 << 20, "alive",
                         NodeProfile(**PROFILE, labels={"host": f"host-{i}"}),  # type: ignore[arg-type]
                         {p: Link(1e9, 0.001, 0.03, now) for p in ids if p != i})
            for n, i in enumerate(ids)]


async def test_a_whole_view_of_96_members_goes_in_parts_that_fit_the_control_lane() -> None:
    swarm = Swarm(signed=False)  # plaintext: the records need no signatures to be held
    try:
        a = await swarm.add("a")
        b = await swarm.add("b")
        ids = [f"n{i:020x}" for i in range(MEMBERS)]
        assert a._membership is not None
        a._membership.merge(_records(ids), time.monotonic())
        parts = a._view_messages()
        # One message would not fit (the old whole-view Gossip of 96 members was 1.2 MB).
        assert len(parts) > 1
        everyone = set(a._membership.ids())
        assert everyone >= {"a", *ids}
        bodies: set[str] = set()
        for msg in parts:
            size = sum(memoryview(p).nbytes for p in encode_message(msg))
            assert size <= DEFAULT_LIMITS.max_control_frame_bytes
            assert size <= 1.5 * VIEW_PART_BYTES
            named = {e.node_id for e in msg.members}
            assert named == everyone  # every part names every member
            full = {e.node_id for e in msg.members if e.profile is not None}
            assert "a" in full  # the sender's own body rides in every part
            bodies |= full
        assert bodies >= set(ids)
        # A peer that merges the parts holds every member's links, as from one message.
        for msg in parts:
            await b.handle("a", msg)
        links = b.view().links
        for i in ids[:3] + ids[-3:]:
            assert sum(1 for (src, _dst) in links if src == i) == MEMBERS - 1
    finally:
        await swarm.close()
