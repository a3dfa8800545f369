"""deploy.testbed: an emulated geo-distributed testbed in network namespaces (run as root).

    python -m deploy.testbed up three-hosts --name fzt1     # build it (prints status)
    python -m deploy.testbed check fzt1                     # configured vs measured, per pair
    python -m deploy.testbed down fzt1                      # remove everything it made

From Python::

    with testbed("three-hosts") as tb:
        tb.exec("a", ["python", "-m", "fusiond", ...])
        results = tb.check()

docs/testbed.md describes topology files, the shaping and delay mechanisms, and cleanup.
"""

from deploy.testbed.bed import (
    DEFAULT_STATE_DIR,
    OUT_OF_MEMORY,
    MemoryReport,
    PairResult,
    Testbed,
    TestbedError,
    classify_exit,
    detect_cgroup,
    detect_memory_cgroup,
    down_recorded,
    list_namespaces,
    namespace_pids,
    read_memory_report,
    recorded_testbeds,
    remove_stray,
    stray_namespaces,
    testbed,
)
from deploy.testbed.topology import (
    LinkSpec,
    Topology,
    TopologyError,
    load_topology,
    parse_topology,
)

__all__ = [
    "DEFAULT_STATE_DIR",
    "OUT_OF_MEMORY",
    "LinkSpec",
    "MemoryReport",
    "PairResult",
    "Testbed",
    "TestbedError",
    "Topology",
    "TopologyError",
    "classify_exit",
    "detect_cgroup",
    "detect_memory_cgroup",
    "down_recorded",
    "list_namespaces",
    "load_topology",
    "namespace_pids",
    "parse_topology",
    "read_memory_report",
    "recorded_testbeds",
    "remove_stray",
    "stray_namespaces",
    "testbed",
]
