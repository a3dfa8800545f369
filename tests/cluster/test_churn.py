"""Safety under churn: random partitions, cut links, crashes and restarts of 5 nodes; at no
moment do two nodes lead in the same term, and once all is healed exactly one leads."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.cluster.fakes import FakeHub, Swarm, agreed_leader, until

IDS = ["c1", "c2", "c3", "c4", "c5"]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
async def test_one_leader_per_term_under_churn(seed: int) -> None:
    rng = random.Random(seed)
    swarm = Swarm(FakeHub())
    leaders: dict[int, set[str]] = {}
    try:
        await swarm.add("c1")
        for nid in IDS[1:]:
            await swarm.add(nid, bootstrap=[swarm.addresses["c1"]])
        loop = asyncio.get_running_loop()

        async def watch(seconds: float) -> None:
            end = loop.time() + seconds
            while loop.time() < end:
                for nid, node in list(swarm.nodes.items()):
                    v = node.view()
                    if v.leader == nid:  # a node's own claim: it holds a lease in v.term
                        leaders.setdefault(v.term, set()).add(nid)
                await asyncio.sleep(0.01)

        await watch(1.5)
        for _ in range(6):
            event = rng.choice(["partition", "cut", "crash", "heal"])
            if event == "partition":
                side = set(rng.sample(IDS, 2))
                swarm.hub.partition(side, set(IDS) - side)
            elif event == "cut":
                a, b = rng.sample(IDS, 2)
                swarm.hub.cut(a, b)
            elif event == "crash":
                victim = rng.choice(sorted(swarm.nodes))
                await swarm.crash(victim)
                await watch(rng.uniform(0.3, 1.0))
                seed_node = rng.choice([n for n in IDS if n != victim])
                await swarm.add(victim, bootstrap=[swarm.addresses[seed_node]])
            else:
                swarm.hub.heal()
            await watch(rng.uniform(0.8, 1.5))
        swarm.hub.heal()

        def settled() -> bool:
            views = swarm.views()
            return (agreed_leader(views) is not None
                    and all(v.alive_voters == 5 for v in views.values()))

        await until(settled, 10, "one leader after the churn")
        await watch(0.2)
        split = {t: ids for t, ids in leaders.items() if len(ids) > 1}
        assert not split, f"two leaders in one term: {split}"
        assert leaders, "nobody ever led"
    finally:
        await swarm.close()
