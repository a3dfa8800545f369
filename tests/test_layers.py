"""The shape of the product packages, enforced: nothing imports upward, no room depends on
another in a cycle, and `protocol/` stays sans-IO (in the manner of python-zeroconf's
circular-import test, but on the source, so that a lazy import inside a function counts too).

Rooms of `fusiond/` have a floor; a room may import only rooms on lower floors (or its own).
The known breaks of today are listed in `KNOWN` with why; each is work of the restructuring
issue (jobs/ by role, harnesses out of the product). The list only shrinks: a new break fails,
and so does a listed one that no longer exists (remove it from the list).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: fusiond's rooms (a package, or a top-level module) by floor, lowest first
FLOORS: dict[str, int] = {
    "errors": 0, "units": 0, "durable": 0, "opsets": 0, "tasks": 0, "defaults": 0, "heap": 0,
    "config": 1, "net": 1, "graph": 1, "models": 1,
    "plan": 2, "cluster": 2,
    "profile": 3, "train": 3,
    "jobs": 4, "metrics": 4,
    "api": 5,
    "daemon": 6,
    "cli": 7,
    "harness": 8,
    "__main__": 9,
}
"""`harness` (clusters in a process, bare nodes, the local run) may import every product room
and no product room imports it. Every `__main__.py` is an entry point (`python -m` runs it,
nothing imports it), so it sits in the `__main__` room at the top, whatever package holds it."""

#: (room, room it imports) breaks known today, and why; the list must only shrink
KNOWN: dict[tuple[str, str], str] = {}

#: what protocol/ may import besides itself and the standard library's pure parts
PROTOCOL_ALLOWED = {"numpy", "msgpack", "xxhash", "lz4"}
#: never in protocol/: I/O, event loops, torch, or the packages above it
PROTOCOL_FORBIDDEN = {"asyncio", "socket", "ssl", "selectors", "threading", "subprocess",
                      "torch", "aiohttp", "zeroconf", "uvloop", "fusiond", "fusionctl"}


def _imports(path: Path) -> Iterator[str]:
    """Every absolute module name `path` imports, at module level or inside a function."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            if node.module == "fusiond":  # `from fusiond import profile`
                for alias in node.names:
                    yield f"fusiond.{alias.name}"


def _room(path: Path) -> str:
    rel = path.relative_to(REPO / "fusiond").with_suffix("")
    return "__main__" if rel.name == "__main__" else rel.parts[0]


def _room_edges() -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> the files that do it."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted((REPO / "fusiond").rglob("*.py")):
        src = _room(path)
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] == "fusionctl":
                dst = "fusionctl"
            elif parts[0] == "fusiond" and len(parts) > 1:
                dst = "__main__" if parts[-1] == "__main__" else parts[1]
            else:
                continue
            if dst != src:
                edges.setdefault((src, dst), []).append(str(path.relative_to(REPO)))
    return edges


def test_every_room_has_a_floor() -> None:
    rooms = {_room(p) for p in (REPO / "fusiond").rglob("*.py")} - {"__init__"}
    assert rooms <= set(FLOORS), f"give these rooms a floor in FLOORS: {rooms - set(FLOORS)}"


def test_nothing_in_fusiond_imports_upward() -> None:
    bad = []
    for (src, dst), files in sorted(_room_edges().items()):
        if (src, dst) in KNOWN:
            continue
        if dst in ("fusionctl", "tests", "bench", "deploy"):
            bad.append(f"{src} -> {dst} ({', '.join(sorted(set(files)))}): the daemon never "
                       "imports its client, tests or harnesses")
        elif dst in FLOORS and FLOORS[dst] >= FLOORS[src]:
            bad.append(f"{src} (floor {FLOORS[src]}) -> {dst} (floor {FLOORS[dst]}) in "
                       f"{', '.join(sorted(set(files)))}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_known_breaks_still_exist() -> None:
    edges = _room_edges()
    gone = [f"{src} -> {dst}" for (src, dst) in KNOWN if (src, dst) not in edges]
    assert not gone, f"fixed, remove from KNOWN: {gone}"


def test_no_cycle_between_rooms_beyond_the_known_breaks() -> None:
    graph: dict[str, set[str]] = {}
    for (src, dst) in _room_edges():
        if (src, dst) not in KNOWN:
            graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(m):], m]))
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_protocol_is_sans_io() -> None:
    import sys

    stdlib = set(sys.stdlib_module_names)
    bad = []
    for path in sorted((REPO / "protocol").rglob("*.py")):
        for mod in _imports(path):
            top = mod.split(".")[0]
            if top in PROTOCOL_FORBIDDEN:
                bad.append(f"{path.relative_to(REPO)} imports {mod}")
            elif top not in stdlib and top != "protocol" and top not in PROTOCOL_ALLOWED:
                bad.append(f"{path.relative_to(REPO)} imports {mod} (not allowed in protocol/)")
    assert not bad, "\n".join(bad)


#: (fusionctl file, fusiond module it imports) allowed although in a daemon room, and why
FUSIONCTL_ALLOWED: dict[tuple[str, str], str] = {
    ("fusionctl/local.py", "fusiond.net.pki"): "`fusionctl local up` writes each node's CA and "
        "certificate in the daemon's on-disk format before the daemons start (pure file "
        "crypto, no service)",
}


def test_fusionctl_never_imports_the_daemons_service_rooms() -> None:
    """fusionctl is a thin client: it captures and checks a job as the user (fusiond's graph,
    models, train spec and jobs.submit) but never runs a daemon's service."""
    bad = []
    for path in sorted((REPO / "fusionctl").rglob("*.py")):
        for mod in _imports(path):
            parts = mod.split(".")
            if (str(path.relative_to(REPO)), mod) in FUSIONCTL_ALLOWED:
                continue
            if parts[0] == "fusiond" and len(parts) > 1 and parts[1] in (
                    "daemon", "api", "cluster", "net"):
                bad.append(f"{path.relative_to(REPO)} imports {mod}")
    assert not bad, "\n".join(bad)
