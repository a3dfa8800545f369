"""``python -m deploy.testbed up|down|check|status|exec|list`` (run as root).

Exit codes: 0 success, 1 a check FAILed or a step failed (the message says which), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from deploy.testbed.bed import (
    DEFAULT_STATE_DIR,
    LATENCY_MODES,
    Testbed,
    TestbedError,
    down_recorded,
    recorded_testbeds,
    remove_stray,
    stray_namespaces,
)
from deploy.testbed.topology import TOPOLOGY_DIR, TopologyError, load_topology, resolve_path


def _find(arg: str | None, state_dir: Path) -> Testbed:
    """A recorded testbed by name, by topology name/path, or the only one there is."""
    names = recorded_testbeds(state_dir)
    if arg in names:
        return Testbed.load(arg, state_dir)
    loaded = [Testbed.load(n, state_dir) for n in names]
    if arg is not None:
        matches = [tb for tb in loaded if arg in (tb.topology.name, tb.topology_path,
                                                  Path(tb.topology_path).stem)]
    else:
        matches = loaded
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise TestbedError(f"no testbed {arg or ''} is up (state dir {state_dir})".replace(
            "  ", " "))
    raise TestbedError(f"several testbeds match: {', '.join(t.name for t in matches)}; "
                       "name one")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    ap = argparse.ArgumentParser(prog="python -m deploy.testbed",
                                 description="An emulated WAN in network namespaces (root).")
    ap.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                    help=f"where testbeds are recorded (default {DEFAULT_STATE_DIR}; "
                    "env FUSION_TESTBED_STATE)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a testbed from a topology (file or bundled name)")
    up.add_argument("topology")
    up.add_argument("--name", default=None, help="testbed name (default fzt<pid>)")
    up.add_argument("--latency", choices=LATENCY_MODES, default="auto",
                    help="how RTTs are emulated: netem (kernel qdisc), nfqueue (userspace "
                    "delay stage on the bridge), auto (netem if the kernel has it, else "
                    "nfqueue; default), none (rates only)")
    up.add_argument("--start-cmd", default=None, metavar="TEMPLATE",
                    help="shell command started in each host; placeholders {host} {addr} "
                    "{index} {ns} {name} {work} {peers} {first}")
    up.add_argument("--fusiond", action="store_true",
                    help="start a fusiond in each host, all in one cluster (mutual TLS from "
                    "one CA; host 1 is the bootstrap address), and wait for a scheduler")
    up.add_argument("--fusiond-insecure", action="store_true",
                    help="with --fusiond: plaintext peer links instead of TLS")
    up.add_argument("--wait", type=float, default=90.0,
                    help="with --fusiond: seconds to wait for agreement")
    down = sub.add_parser("down", help="remove a testbed and everything it made")
    down.add_argument("testbed", nargs="?", help="name or topology (default: the only one)")
    down.add_argument("--all", action="store_true",
                      help="every recorded testbed, and namespaces named fzt<N>-* without one")
    chk = sub.add_parser("check", help="measure every pair: configured vs measured")
    chk.add_argument("testbed", nargs="?")
    chk.add_argument("--duration", type=float, default=1.0, help="seconds per bulk transfer")
    chk.add_argument("--tolerance", type=float, default=0.15, help="rate tolerance (0.15)")
    chk.add_argument("--rtt-tolerance-ms", type=float, default=2.0)
    chk.add_argument("--json", action="store_true", help="print only JSON on stdout")
    chk.add_argument("--sample", action="store_true",
                     help="one pair per (group, group, link) instead of every pair")
    st = sub.add_parser("status", help="what runs (all testbeds without a name)")
    st.add_argument("testbed", nargs="?")
    ex = sub.add_parser("exec", help="run a command inside a host: exec TESTBED HOST -- CMD")
    ex.add_argument("testbed")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("list", help="the bundled topologies")
    args = ap.parse_args(argv)

    try:
        if args.cmd == "list":
            for p in sorted(TOPOLOGY_DIR.glob("*.toml")):
                t = load_topology(p)
                print(f"{p.stem:<16} {len(t.hosts)} hosts  {t.description}")
            return 0
        if os.geteuid() != 0 and args.cmd in ("up", "down", "check", "exec"):
            print("deploy.testbed: must run as root (network namespaces, tc, iptables)",
                  file=sys.stderr)
            return 1
        if args.cmd == "up":
            path = str(resolve_path(args.topology).resolve())
            tb = Testbed(load_topology(path), name=args.name, state_dir=args.state_dir,
                         topology_path=path)
            tb.up(latency=args.latency)
            try:
                if args.start_cmd:
                    tb.start_each(args.start_cmd)
                if args.fusiond:
                    from deploy.testbed.fusion import start_fusiond

                    print(start_fusiond(tb, insecure=args.fusiond_insecure, wait_s=args.wait,
                                        progress=lambda s: print(s, file=sys.stderr)).summary)
            except BaseException:
                tb.down()
                raise
            print(tb.describe())
            print(f"\nnext: python -m deploy.testbed check {tb.name}   |   "
                  f"python -m deploy.testbed down {tb.name}")
            return 0
        if args.cmd == "down":
            if args.all:
                bad = []
                for name in recorded_testbeds(args.state_dir):
                    bad += down_recorded(name, args.state_dir)
                    print(f"removed {name}")
                for ns in remove_stray(args.state_dir):
                    print(f"removed stray namespace {ns}")
            else:
                # By name from the state alone (works even if the topology no longer parses).
                name = (args.testbed if args.testbed in recorded_testbeds(args.state_dir)
                        else _find(args.testbed, args.state_dir).name)
                bad = down_recorded(name, args.state_dir)
                print(f"removed {name}")
            for b in bad:
                print(f"NOT removed: {b}", file=sys.stderr)
            return 1 if bad else 0
        if args.cmd == "status":
            names = ([args.testbed] if args.testbed else recorded_testbeds(args.state_dir))
            if not names:
                print(f"no testbed is up (state dir {args.state_dir})")
            for n in names:
                print(_find(n, args.state_dir).describe())
            stray = stray_namespaces(args.state_dir)
            if stray:
                print(f"stray namespaces (no state; `down --all` removes them): {stray}")
            return 0
        if args.cmd == "exec":
            tb = _find(args.testbed, args.state_dir)
            argv_ = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not argv_:
                ap.error("exec needs a command after the host")
            proc = tb.exec(args.host, argv_, stdout=None, stderr=None)
            return proc.wait()
        # check
        tb = _find(args.testbed, args.state_dir)
        results = tb.check(duration_s=args.duration, rate_tolerance=args.tolerance,
                           rtt_tolerance_s=args.rtt_tolerance_ms / 1e3,
                           pairs=tb.topology.representative_pairs() if args.sample else None)
        if args.json:
            print(json.dumps([{"src": r.src, "dst": r.dst, "rate_bits_per_s": r.rate_bits_per_s,
                               "rtt_s": r.rtt_s, "measured_bits_per_s": r.measured_bits_per_s,
                               "measured_rtt_s": r.measured_rtt_s, "ok": r.ok,
                               "error": r.error} for r in results]))
        else:
            print(f"testbed {tb.name} ({tb.topology.name}): rate within "
                  f"{args.tolerance:.0%}, RTT within {args.rtt_tolerance_ms:g} ms")
            print(f"{'src':>8}    {'dst':<8} {'rate':>12} {'measured':>12}   "
                  f"{'rtt':>10} {'measured':>10}")
            for r in results:
                print(r.line())
            fails = sum(not r.ok for r in results)
            print(f"check: {len(results) - fails} pairs PASS, {fails} FAIL")
        return 0 if all(r.ok for r in results) else 1
    except (TestbedError, TopologyError) as exc:
        print(f"deploy.testbed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
