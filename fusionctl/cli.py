"""fusionctl: the command-line client of fusiond. Thin: every command asks the daemon.

Exit codes (also in ``--help`` and docs/cli.md):

==  ===========================================================================
0   success
1   the daemon refused or failed the request (the message says why and what next)
2   usage error (bad arguments)
3   no daemon answers at the API address (the message says how to start one)
4   timed out waiting (``local up`` waiting for the daemons to agree)
5   ``submit``: the job failed (the first-failure report names machine, stage, step, cause)
6   ``submit``: the job was cancelled
7   ``submit``/``fetch``: the outputs could not be written here (the message names the file
    and the cause, and the ``fusionctl fetch ID`` that writes them once it is fixed)
8   ``status``: the daemon answers but this node is in no working cluster: unconfigured,
    left, or without quorum (the output says which and what to run)
130 interrupted (Ctrl-C); a job `submit` was following runs on
==  ===========================================================================
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import fusionctl
from fusionctl.client import (
    DEFAULT_SOCKET,
    ApiFailure,
    Client,
    ClientError,
    NoAnswer,
    NotPermitted,
    Unreachable,
    endpoint_from,
    env_default,
)
from fusionctl.render import fmt_age, render_links, render_status

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_TIMEOUT = 4
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT), as shells and the other tools report it."""
EXIT_NOT_SERVING = 8
"""`status`: the daemon answers, but this node is in no working cluster."""

EXIT_CODES_HELP = """exit codes:
  0  success
  1  the daemon refused or failed the request (the message says what to do next)
  2  usage error
  3  no daemon answers at the API address (start one: `systemctl start fusiond`,
     or `fusiond --config PATH`, or `fusionctl local up -n 3` for a dev cluster)
  4  timed out waiting (local up)
  5  submit: the job failed (the report names machine, stage, step and cause)
  6  submit: the job was cancelled
  7  submit/fetch: the outputs could not be written here (the message names the file and
     the cause; `fusionctl fetch ID [--output DIR]` writes them once it is fixed)
  8  status: the daemon answers but this node is in no working cluster (unconfigured,
     left, or no quorum)
  130  interrupted (Ctrl-C); after `submit` the job runs on

environment: FUSION_API_SOCKET (default /run/fusion/fusiond.sock), FUSION_API_TCP with
FUSION_API_TOKEN or FUSION_API_TOKEN_FILE."""

LOG_HINT = "`journalctl -u fusiond` under systemd, `fusionctl paths` for where it runs"
START_HINT = ("start it with `sudo systemctl start fusiond` (or `fusiond --config PATH`), "
              "or for a development cluster on this machine `fusionctl local up -n 3`; "
              "point fusionctl at another daemon with --socket PATH or --api HOST:PORT")


class Out:
    """Where output goes: stdout for results (JSON only with --json), stderr for the rest."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def result(self, data: Any, human: Callable[[], None]) -> None:
        if self.as_json:
            sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        else:
            human()

    @staticmethod
    def info(text: str) -> None:
        """Progress and notes: stderr, so stdout stays clean for results and --json."""
        from rich.console import Console

        Console(stderr=True, highlight=False).print(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusionctl",
        description="Control a fusion daemon (fusiond) through its local API.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"fusionctl {fusionctl.__version__}")
    p.add_argument("--socket", default=None, metavar="PATH",
                   help=f"daemon API socket (default {DEFAULT_SOCKET}) [env FUSION_API_SOCKET]")
    p.add_argument("--api", default=None, metavar="HOST:PORT",
                   help="loopback TCP API instead of the socket [env FUSION_API_TCP]")
    p.add_argument("--token-file", default=None, metavar="PATH",
                   help="API token for --api [env FUSION_API_TOKEN_FILE or FUSION_API_TOKEN]")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for the daemon's answer (default 30)")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    def cmd(name: str, helptext: str, read: bool = False) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=helptext, description=helptext, epilog=EXIT_CODES_HELP,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        if read:
            sp.add_argument("--json", action="store_true",
                            help="print only JSON on stdout")
        return sp

    sp = cmd("init", "create a new cluster here: CA, this node's certificate, a join token",
             read=True)
    sp.add_argument("--ttl", type=float, default=24 * 3600, metavar="S",
                    help="join token lifetime in seconds (default 24 h)")
    sp.add_argument("--one-time", action="store_true", help="the token admits one node only")
    sp = cmd("join", "join a cluster with a token (or add a member address, host:port)",
             read=True)
    sp.add_argument("target", metavar="TOKEN|ADDR")
    sp = cmd("token", "make a new join token (on a member holding the cluster CA)", read=True)
    sp.add_argument("--ttl", type=float, default=24 * 3600, metavar="S",
                    help="lifetime in seconds (default 24 h)")
    sp.add_argument("--reusable", action="store_true",
                    help="the token may admit several nodes (default: one-time)")
    cmd("status", "this node, the scheduler and term, every peer, link health", read=True)
    cmd("links", "the bandwidth / RTT matrix every member measured", read=True)
    cmd("paths", "where this daemon keeps its state, cache, sockets and metrics", read=True)
    cmd("version", "versions of fusionctl, the daemon, the protocol and torch", read=True)
    sp = cmd("leave", "leave the cluster for good (this node stops counting toward quorum)",
             read=True)
    sp.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    sp = cmd("dashboard", "a link to this daemon's browser dashboard, with a session for you",
             read=True)
    sp.add_argument("--open", action="store_true",
                    help="also open it in the default browser")
    sp = cmd("remove", "remove a member that is gone for good (restores quorum)", read=True)
    sp.add_argument("node", metavar="NODE")
    from fusionctl import jobs as job_cmds

    job_cmds.add_parsers(cmd)
    sp = cmd("completion", "print a shell completion script (bash, zsh or fish)")
    sp.add_argument("shell", choices=("bash", "zsh", "fish"))
    sp = cmd("local", "a development cluster of N daemons on this machine (loopback)")
    lsub = sp.add_subparsers(dest="local_cmd", metavar="up|down|status")
    up = lsub.add_parser("up", help="start N daemons, wait until they agree on a scheduler")
    up.add_argument("-n", type=int, default=3, help="number of daemons (default 3)")
    up.add_argument("--dir", default=None,
                    help="where their state lives (default $XDG_RUNTIME_DIR or /tmp)")
    up.add_argument("--insecure", action="store_true",
                    help="plaintext links instead of a local CA + mutual TLS")
    up.add_argument("--discovery", choices=("mdns", "bootstrap"), default="mdns",
                    help="how the daemons find each other (default mdns on 127.0.0.1)")
    up.add_argument("--wait", type=float, default=60.0, metavar="S",
                    help="seconds to wait for agreement (default 60)")
    up.add_argument("--benchmark", action="store_true",
                    help="profile each daemon's speed and find its GPUs (seconds each, cached "
                         "in its state dir); without it the daemons skip the benchmark, are "
                         "planned at a default speed and train on the CPU")
    up.add_argument("--json", action="store_true", help="print only JSON on stdout")
    down = lsub.add_parser("down", help="stop the daemons `local up` started")
    down.add_argument("--dir", default=None)
    down.add_argument("--keep", action="store_true", help="keep their state directories")
    lst = lsub.add_parser("status", help="which local daemons run, and their sockets")
    lst.add_argument("--dir", default=None)
    lst.add_argument("--json", action="store_true", help="print only JSON on stdout")
    return p


def _client(ns: argparse.Namespace) -> Client:
    ep = endpoint_from(
        ns.socket or env_default("FUSION_API_SOCKET"),
        ns.api or env_default("FUSION_API_TCP"),
        env_default("FUSION_API_TOKEN"),
        ns.token_file or env_default("FUSION_API_TOKEN_FILE"),
    )
    return Client(ep, timeout=ns.timeout)


def run(argv: Sequence[str]) -> int:
    """Entry point: returns the exit code."""
    parser = build_parser()
    try:
        ns = parser.parse_args(list(argv))
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    if ns.cmd is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    out = Out(bool(getattr(ns, "json", False)))
    try:
        if ns.cmd == "local":
            return _local(ns, out)
        if ns.cmd == "completion":
            from fusionctl.completion import script

            sys.stdout.write(script(ns.shell, parser))
            return EXIT_OK
        return _COMMANDS[ns.cmd](_client(ns), ns, out)
    except NoAnswer as e:
        print(f"fusionctl: {e}.\n  Something listens there but did not answer: the daemon "
              "is busy or stuck, not stopped. Wait and try again, or allow longer with "
              f"--timeout S; its log says what it is doing ({LOG_HINT}).", file=sys.stderr)
        return EXIT_UNREACHABLE
    except NotPermitted as e:
        print(f"fusionctl: {e}.\n  The daemon may well be running, but this user may not "
              "open its socket (mode 0660, group fusion under the shipped unit): join the "
              "group (`sudo usermod -aG fusion $USER`, then log in again), use sudo, or point "
              "fusionctl at a daemon of your own with --socket PATH.", file=sys.stderr)
        return EXIT_UNREACHABLE
    except Unreachable as e:
        print(f"fusionctl: {e}.\n  The daemon is not running or listens elsewhere: "
              f"{START_HINT}.", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        print(f"\nfusionctl {ns.cmd}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ApiFailure as e:
        print(f"fusionctl {ns.cmd}: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    except ClientError as e:
        print(f"fusionctl {ns.cmd}: {e}", file=sys.stderr)
        return EXIT_USAGE


# -- commands ----------------------------------------------------------------------------------


def _status(c: Client, ns: argparse.Namespace, out: Out) -> int:
    data = c.get("/v1/status")
    out.result(data, lambda: render_status(data))
    return EXIT_OK if serving(data) else EXIT_NOT_SERVING


def serving(status: dict[str, Any]) -> bool:
    """Whether `status` is a node in a working cluster: running, and with a quorum (what a
    script asks with `fusionctl status >/dev/null`)."""
    node = status.get("node") or {}
    view = status.get("cluster")
    return (node.get("phase") == "running" and isinstance(view, dict)
            and bool(view.get("has_quorum")))


def _links(c: Client, ns: argparse.Namespace, out: Out) -> int:
    data = c.get("/v1/links")
    out.result(data, lambda: render_links(data))
    return EXIT_OK


def _paths(c: Client, ns: argparse.Namespace, out: Out) -> int:
    data = c.get("/v1/paths")

    def human() -> None:
        for k, v in data.items():
            print(f"{k:<15} {v if v is not None else '(none)'}")

    out.result(data, human)
    return EXIT_OK


def _version(c: Client, ns: argparse.Namespace, out: Out) -> int:
    mine = {"fusionctl": fusionctl.__version__}
    try:
        data = {**mine, **c.get("/v1/version")}
    except Unreachable:
        out.result({**mine, "daemon": None}, lambda: print(f"fusionctl {fusionctl.__version__}"))
        raise
    out.result(data, lambda: print(
        f"fusionctl {data['fusionctl']}\nfusiond   {data.get('fusiond')}\n"
        f"protocol  {data.get('protocol')} (accepts {data.get('protocol_min')}.."
        f"{data.get('protocol')})\ntorch     {data.get('torch')}\npython    {data.get('python')}"))
    return EXIT_OK


def _init(c: Client, ns: argparse.Namespace, out: Out) -> int:
    data = c.post("/v1/init", {"ttl_s": ns.ttl, "one_time": bool(ns.one_time)})
    out.result(data, lambda: print(
        f"created cluster {data['cluster_id']}; this node is {data['node_id']}\n\n"
        f"join token ({'one-time, ' if data.get('one_time') else ''}valid "
        f"{fmt_age(data.get('expires_in_s'))}):\n  {data['token']}\n\n"
        f"next, on each other machine (with fusiond running):\n  {data['next']}"))
    return EXIT_OK


def _token(c: Client, ns: argparse.Namespace, out: Out) -> int:
    data = c.post("/v1/token", {"ttl_s": ns.ttl, "one_time": not ns.reusable})
    out.result(data, lambda: print(
        f"{data['token']}\n\nnext, on the joining machine:\n  {data['next']}"))
    return EXIT_OK


def _join(c: Client, ns: argparse.Namespace, out: Out) -> int:
    t = ns.target.strip()
    body = {"token": t} if t.startswith("fusion1.") else {"address": t}
    data = c.post("/v1/join", body)

    def human() -> None:
        if data.get("already_member"):
            print(f"already a member of cluster {data['cluster_id']} (node {data['node_id']})")
        else:
            print(f"joined cluster {data.get('cluster_id')} as node {data['node_id']}")
        boot = data.get("bootstrap")
        if boot:
            print(f"bootstrap: {', '.join(boot) if isinstance(boot, list) else boot}")
        print(f"\nnext:\n  {data.get('next', 'fusionctl status')}")

    out.result(data, human)
    return EXIT_OK


def leave_losses(jobs: dict[str, Any]) -> list[str]:
    """What leaving would cost, from `GET /v1/jobs`: the stages this node runs, the running
    jobs it took the submission of."""
    lost = [f"stage {s.get('stage')} of job {s.get('job_id')} runs here: it stops, and the job "
            "restarts without this machine from its last checkpoint (the steps since are "
            "redone), or fails when it has no restart left"
            for s in jobs.get("stages") or [] if s.get("running")]
    lost += [f"job {j.get('job_id')} was submitted here and still runs: its updates and "
             "outputs come back to this daemon, which stops taking them (the scheduler keeps "
             "the weights it could not deliver: `fusionctl fetch` after joining again)"
             for j in jobs.get("jobs") or [] if j.get("state") == "running"]
    return lost


def _leave(c: Client, ns: argparse.Namespace, out: Out) -> int:
    try:
        lost = leave_losses(c.get("/v1/jobs"))
    except ApiFailure:
        lost = []
    for line in lost:
        print(f"WARNING: {line}", file=sys.stderr)
    if not ns.yes and sys.stdin.isatty():
        ans = input("leave the cluster for good? this node stops counting toward quorum"
                    f"{' and the work above is lost' if lost else ''} [y/N] ")
        if ans.strip().lower() not in ("y", "yes"):
            print("not leaving", file=sys.stderr)
            return EXIT_FAILED
    elif lost and not ns.yes:
        print("fusionctl leave: not leaving while this node has work (above); wait for it, "
              "`fusionctl cancel ID` it, or run `fusionctl leave --yes` to leave anyway",
              file=sys.stderr)
        return EXIT_FAILED
    data = c.post("/v1/leave")
    out.result(data, lambda: print(f"left cluster {data.get('cluster_id')}\n\nnext (to join a "
                                   f"cluster again):\n  fusionctl join TOKEN"))
    return EXIT_OK


def _remove(c: Client, ns: argparse.Namespace, out: Out) -> int:
    data = c.post("/v1/remove", {"node_id": ns.node})
    out.result(data, lambda: print(f"removed {data['removed']}; it no longer counts toward "
                                   f"quorum\n\nnext:\n  fusionctl status"))
    return EXIT_OK


def _dashboard(c: Client, ns: argparse.Namespace, out: Out) -> int:
    data = c.post("/v1/dashboard")
    out.result(data, lambda: print(
        f"dashboard for {data.get('viewer')} (valid {fmt_age(data.get('expires_in_s'))}):\n"
        f"  {data['url']}\n\nthe link holds a session: whoever has it sees what you see "
        "until it expires"))
    if ns.open:
        import webbrowser

        if not webbrowser.open(data["url"]):
            Out.info("no browser to open here: copy the link into one on this machine")
    return EXIT_OK


_COMMANDS: dict[str, Callable[[Client, argparse.Namespace, Out], int]] = {
    "status": _status, "links": _links, "paths": _paths, "version": _version, "init": _init,
    "token": _token, "join": _join, "leave": _leave, "remove": _remove,
    "dashboard": _dashboard,
}


def _job_commands() -> None:
    from fusionctl import jobs as j

    _COMMANDS.update({"submit": j.submit, "plan": j.plan, "jobs": j.list_jobs,
                      "job": j.show_job, "cancel": j.cancel, "logs": j.logs,
                      "fetch": j.fetch})


_job_commands()


def _local(ns: argparse.Namespace, out: Out) -> int:
    from fusionctl import local

    directory = local.default_dir() if ns.dir is None else ns.dir
    if ns.local_cmd == "up":
        try:
            info = local.up(ns.n, directory, insecure=ns.insecure, discovery=ns.discovery,
                            wait_s=ns.wait, progress=None if out.as_json else Out.info,
                            settings={"profile_benchmark": True} if ns.benchmark else None)
        except local.LocalTimeout as e:
            print(f"fusionctl local up: {e}", file=sys.stderr)
            return EXIT_TIMEOUT
        except local.LocalClusterError as e:
            print(f"fusionctl local up: {e}", file=sys.stderr)
            return EXIT_FAILED
        out.result(info, lambda: print(local.howto(info)))
        return EXIT_OK
    if ns.local_cmd == "down":
        local.down(directory, keep=ns.keep, progress=Out.info)
        return EXIT_OK
    if ns.local_cmd == "status":
        info = local.describe(directory)
        out.result(info, lambda: print(local.howto(info) if info.get("nodes")
                                       else f"no local cluster in {directory}"))
        return EXIT_OK
    print("fusionctl local: say `up -n N`, `down` or `status`", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(sys.argv[1:]))


__all__ = ["EXIT_FAILED", "EXIT_NOT_SERVING", "EXIT_OK", "EXIT_TIMEOUT", "EXIT_UNREACHABLE",
           "EXIT_USAGE", "run"]
