"""ClusterConfig validation: a bad value is a ConfigError naming the key."""

from __future__ import annotations

import pytest

from fusiond.cluster import ClusterConfig
from fusiond.errors import ConfigError


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"gossip_interval_s": 0}, "gossip_interval_s"),
        ({"dead_after_s": float("nan")}, "dead_after_s"),
        ({"suspect_after_s": 6.0, "dead_after_s": 5.0}, "suspect_after_s"),
        ({"leader_lease_s": 3.5}, "leader_lease_s"),  # above the 3 s election timeout
        ({"leader_heartbeat_s": 2.5}, "leader_heartbeat_s"),  # above the 2 s lease
        ({"gossip_fanout": 0}, "gossip_fanout"),
        ({"bandwidth_ewma": 0.0}, "bandwidth_ewma"),
    ],
)
def test_bad_values_name_the_key(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        ClusterConfig(**kwargs)  # type: ignore[arg-type]


def test_lists_from_the_daemon_config_become_tuples() -> None:
    cfg = ClusterConfig(mdns_interfaces=["127.0.0.1"],  # type: ignore[arg-type]
                        bootstrap=[["10.0.0.1", "7420"]])  # type: ignore[arg-type]
    assert cfg.mdns_interfaces == ("127.0.0.1",)
    assert cfg.bootstrap == (("10.0.0.1", 7420),)
