"""The defaults of the peer transport's and the cluster service's settings, defined once.

`fusiond.config` reads them as the ``[net]`` and ``[cluster]`` sections of ``fusiond.toml``
(every field a key; the attribute docstrings here are ``fusiond --help``'s text), and
`fusiond.net.transport.NetConfig` and `fusiond.cluster.service.ClusterConfig` take their
defaults from them, so a daemon started without a config file and a transport or cluster built
in code without arguments run on the same timers (they once differed: connect timeout 5 vs
10 s, gossip interval 1.0 vs 0.5 s, election timeout 3 vs 1 s). On the lowest floor so the
transport (the same floor as the config loader) may import it; nothing here imports anything
of fusiond. tests/daemon/test_config.py keeps the three in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DEFAULT_PEER_PORT", "ClusterSection", "NetSection"]

DEFAULT_PEER_PORT = 7420


@dataclass
class NetSection:
    """Peer transport (fusiond.net): where we listen, what we advertise, link timeouts."""

    listen: str = f"0.0.0.0:{DEFAULT_PEER_PORT}"
    """host:port the peer listener binds; port 0 picks a free port (tests)."""
    advertise: str = ""
    """host:port other peers should dial; empty: the listen address (its host, if 0.0.0.0)."""
    insecure_plaintext: bool = False
    """Peer links without TLS: loopback development only; logged loudly and shown in status."""
    allow_plaintext_remote: bool = False
    """With insecure_plaintext, also listen on a non-loopback address (never do this)."""
    connect_timeout_s: float = 5.0
    """Dialing a peer gives up after this long."""
    handshake_timeout_s: float = 5.0
    """TLS plus the Hello exchange must finish within this long."""
    close_timeout_s: float = 5.0
    """Closing the listener waits at most this long on shutdown."""
    backoff_initial_s: float = 0.2
    """First reconnect delay after a failed dial; doubles up to backoff_max_s, jittered."""
    backoff_max_s: float = 10.0
    """Upper bound of the reconnect delay."""
    control_queue_frames: int = 1024
    """Control frames queued per peer before `send` waits (backpressure)."""
    bulk_queue_frames: int = 16
    """Tensor frames queued per peer before `send` waits (backpressure)."""
    inbox_frames: int = 64
    """Decoded messages waiting for the handler per connection before reading pauses."""
    inbox_bytes: int = 128 << 20
    """Bytes of decoded frames waiting for the handler per connection before reading pauses
    (one larger frame still passes, alone)."""
    backoff_jitter: float = 0.5
    """Each reconnect delay is multiplied by a random factor in [1 - jitter, 1 + jitter]."""
    bulk_chunk_bytes: int = 256 << 10
    """Tensor frames are written in chunks of this size, so control frames interleave."""
    direct_payload_bytes: int = 64 << 10
    """Payloads at least this large are received straight into their own buffer."""
    write_high_water_bytes: int = 4 << 20
    """Bytes buffered in a connection's transport before the writer waits for it to drain."""
    max_pending_handshakes: int = 256
    """Accepted connections still in their TLS/Hello handshake; more are closed (slow-loris)."""
    max_pending_handshakes_per_source: int = 16
    """Connections in their handshake from one address no member was authenticated from."""
    member_handshake_reserve: int = 64
    """Of max_pending_handshakes, slots kept for addresses of known members."""
    max_inbound_per_peer_lane: int = 4
    """Authenticated connections accepted per peer and lane; a new one closes the oldest."""
    frame_deadline_floor_s: float = 30.0
    """A frame in progress must be complete within max(this, factor x bytes / link rate)."""
    frame_deadline_factor: float = 4.0
    """Slack over the measured link rate a frame in progress gets before it is cut off."""
    default_link_bytes_per_s: float = 125000.0
    """Link rate assumed for frame deadlines until the link is measured (1 Mbit/s)."""
    refusal_log_interval_s: float = 10.0
    """Refused-connection warnings: refusal_log_burst lines per source and kind per interval,
    then one summary line."""
    refusal_log_burst: int = 5
    """Refused-connection warnings logged one by one per source and kind per interval."""
    payload_check: str = "auto"
    """xxh3 checksum over payloads: auto (only on plaintext non-loopback links), on or off."""
    tune_allocator: bool = True
    """Tune glibc malloc at start so freed frame buffers are reused (see fusiond.net)."""
    test_drop_switch: bool = False
    """Allow the test-only API endpoint that drops traffic to/from chosen peers. Never in prod."""


@dataclass
class ClusterSection:
    """Discovery, membership, probes and election (fusiond.cluster)."""

    id: str = ""
    """Cluster id in plaintext mode only (with TLS the id derives from the cluster CA)."""
    bootstrap: list[str] = field(default_factory=list)
    """host:port addresses of existing members, tried until one answers."""
    mdns: bool = True
    """Announce and browse `_fusion._tcp` with zeroconf."""
    mdns_interfaces: list[str] = field(default_factory=list)
    """Addresses zeroconf binds to; empty: all interfaces. Tests use 127.0.0.1."""
    bootstrap_retry_s: float = 2.0
    """How often an unanswered bootstrap address is dialled again."""
    gossip_interval_s: float = 1.0
    """How often this node sends its view to a few random peers."""
    gossip_fanout: int = 3
    """Random live peers each gossip round goes to (plus one dead one, to heal partitions)."""
    gossip_full_every: int = 4
    """Every n-th gossip round carries our own profile and links to every target; the others
    only heartbeats."""
    gossip_sync_every: int = 10
    """Every n-th gossip round one random target gets the whole view with everyone's profile
    and links (anti-entropy)."""
    suspect_after_s: float = 5.0
    """No news of a member for this long: it is suspect."""
    dead_after_s: float = 15.0
    """No news of a member for this long: it is dead (it still counts toward quorum)."""
    probes: bool = True
    """Measure RTT and bandwidth to each peer periodically."""
    probe_interval_s: float = 30.0
    """How often the links to each peer are re-measured."""
    probe_target_s: float = 0.3
    """A bandwidth probe is sized to last about this long."""
    probe_repeats: int = 3
    """Bulk transfers per bandwidth measurement."""
    probe_min_bytes: int = 64 << 10
    """Smallest bandwidth probe transfer."""
    probe_max_bytes: int = 64 << 20
    """Largest bandwidth probe transfer (slow links get smaller ones)."""
    probe_timeout_s: float = 5.0
    """A probe that takes longer than this is abandoned."""
    bandwidth_ewma: float = 0.3
    """Weight of a new probe round in a steady link's moving average, in (0, 1] (a round
    clearly off the estimate replaces it)."""
    election_timeout_s: float = 3.0
    """No word from a scheduler for this long: elect a new one."""
    leader_heartbeat_s: float = 0.5
    """How often the scheduler reasserts itself; below leader_lease_s."""
    leader_lease_s: float = 2.0
    """A scheduler steps down without a majority's acks for this long; below
    election_timeout_s, so an old scheduler lets go before a new one can win."""
    election_stagger_s: float = 0.5
    """Lower-ranked candidates wait this much longer per rank before campaigning."""
    election_jitter_s: float = 0.2
    """Random extra delay before campaigning, so candidates do not collide."""
    election_grace_s: float = 3.0
    """After start: no campaigning or voting while the node learns the cluster."""
    send_timeout_s: float = 2.0
    """A control send blocked (peer queue full) longer than this is dropped."""
    tick_s: float = 0.05
    """Failure detector and election timer resolution."""
    max_members: int = 4096
    """Bound on the membership table (peers cannot make this node hold more)."""
    quarantine_s: float = 5.0
    """A peer that relayed a forged or malformed fact is not listened to for this long."""
