"""Human output of fusionctl (rich tables on stdout). JSON output never goes through here."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from rich import box
from rich.console import Console
from rich.table import Table

from protocol.errors import RemoteProtocolError
from protocol.messages import DeviceProfile, NodeProfile

SLOW_FACTOR = 10.0
"""A link is slow when its bandwidth is this many times below the median link (or RTT above)."""


def _console(stderr: bool = False) -> Console:
    """A terminal gets its own width; piped output (scripts, tests) is never truncated unless
    COLUMNS says how wide it may be."""
    c = Console(highlight=False, stderr=stderr)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(highlight=False, stderr=stderr, width=240)
    return c


def fmt_addr(a: Any) -> str:
    if a is None or a == "":
        return "(none)"
    if isinstance(a, list | tuple) and len(a) == 2:
        host = str(a[0])
        return f"[{host}]:{a[1]}" if ":" in host else f"{host}:{a[1]}"
    return str(a)


def fmt_rtt(s: Any) -> str:
    if not isinstance(s, int | float) or s <= 0:
        return "-"
    return f"{s * 1000:.2f} ms" if s < 1 else f"{s:.2f} s"


def fmt_bw(bits_per_s: Any) -> str:
    """A rate in bits per second, as ``19.1 Mbit/s``."""
    if not isinstance(bits_per_s, int | float) or bits_per_s <= 0:
        return "-"
    for unit, div in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= div:
            return f"{bits_per_s / div:.1f} {unit}"
    return f"{bits_per_s:.0f} bit/s"


def fmt_bw_spread(bits_per_s: Any, spread_ratio: Any) -> str:
    """A rate and the accuracy of the probe round behind it: ``19.1 Mbit/s ±2%``."""
    text = fmt_bw(bits_per_s)
    if text != "-" and isinstance(spread_ratio, int | float) and spread_ratio > 0:
        text += f" ±{spread_ratio * 100:.0f}%"
    return text


def fmt_age(age_s: Any) -> str:
    """A duration (how old a measurement is, how long a token stays valid): ``12s``,
    ``3m05s``, ``2h10m``; the one duration formatter of fusionctl."""
    if not isinstance(age_s, int | float) or age_s < 0:
        return "-"
    s = int(age_s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt_ops(row: Mapping[str, Any]) -> str:
    """A member's op set: ``211 ops`` or ``210 ops (disabled: aten.gelu.default)``."""
    count = row.get("ops_count")
    if not isinstance(count, int):
        return "-"
    raw = row.get("ops_disabled")
    off = [str(x) for x in raw] if isinstance(raw, list) else []
    return f"{count} ops" + (f" (disabled: {', '.join(off)})" if off else "")


def _short(node_id: Any, width: int = 14) -> str:
    s = str(node_id)
    return s if len(s) <= width else s[: width - 1] + "…"


class LinkRow(NamedTuple):
    """One measured link as fusionctl shows it."""

    bandwidth_bits_per_s: float
    rtt_s: float
    bandwidth_spread_ratio: float | None = None
    """Accuracy of the probe round behind the figure (None: not reported)."""
    age_s: float | None = None
    """Seconds since that round (None: not reported)."""


def _opt(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def link_pairs(links: Any) -> dict[tuple[str, str], LinkRow]:
    """Normalise the links of a cluster view to {(src, dst): LinkRow}.

    Accepts a nested mapping ``{src: {dst: [bw, rtt]}}`` or ``{src: {dst:
    {"bandwidth_bits_per_s", "rtt_s", "bandwidth_spread_ratio", "age_s"}}}`` (the daemon's
    `/v1/links`), or a list of such maps with ``"src"`` and ``"dst"``. Rates are bits/s.
    """
    out: dict[tuple[str, str], LinkRow] = {}

    def val(v: Any) -> LinkRow | None:
        if isinstance(v, list | tuple) and len(v) >= 2:
            return LinkRow(float(v[0] or 0), float(v[1] or 0))
        if isinstance(v, Mapping):
            return LinkRow(float(v.get("bandwidth_bits_per_s") or 0), float(v.get("rtt_s") or 0),
                           _opt(v.get("bandwidth_spread_ratio")), _opt(v.get("age_s")))
        return None

    if isinstance(links, Mapping):
        for src, row in links.items():
            if isinstance(row, Mapping):
                for dst, v in row.items():
                    t = val(v)
                    if t is not None:
                        out[(str(src), str(dst))] = t
    elif isinstance(links, list):
        for e in links:
            if isinstance(e, Mapping):
                src = e.get("src", e.get("a"))
                dst = e.get("dst", e.get("b"))
                t = val(e)
                if src is not None and dst is not None and t is not None:
                    out[(str(src), str(dst))] = t
    return out


def health(view: Mapping[str, Any], me: str) -> list[str]:
    """Lines about dead/suspect members and slow links (empty when all is well)."""
    lines: list[str] = []
    for m in view.get("members", []):
        st = m.get("state")
        if st in ("dead", "suspect"):
            tail = (f"; if it is gone for good: fusionctl remove {m['node_id']}"
                    if st == "dead" else "")
            lines.append(f"{m['node_id']} ({fmt_addr(m.get('address'))}) is {st}{tail}")
        prof = m.get("profile")
        err = prof.get("device_error") if isinstance(prof, Mapping) else None
        if err and m.get("node_id") != me and st not in ("dead", "left"):
            lines.append(f"{m['node_id']}: its GPU is not used: {err}")
    gone = {m.get("node_id") for m in view.get("members", [])
            if m.get("state") in ("dead", "left")}
    pairs = {k: v for k, v in link_pairs(view.get("links")).items()
             if k[0] not in gone and k[1] not in gone}
    bws = [lk.bandwidth_bits_per_s for lk in pairs.values() if lk.bandwidth_bits_per_s > 0]
    rtts = [lk.rtt_s for lk in pairs.values() if lk.rtt_s > 0]
    if len(bws) >= 3:
        med = statistics.median(bws)
        for (a, b), lk in sorted(pairs.items()):
            bw = lk.bandwidth_bits_per_s
            if 0 < bw < med / SLOW_FACTOR:
                lines.append(f"slow link {_short(a)} -> {_short(b)}: {fmt_bw(bw)} "
                             f"(median {fmt_bw(med)})")
    if len(rtts) >= 3:
        med = statistics.median(rtts)

        def high(r: float) -> bool:
            return r > med * SLOW_FACTOR and r > 0.005

        for (a, b), lk in sorted(pairs.items()):
            # A link's RTT is one probe round's figure: a single slow sample (a busy event
            # loop on either end) reads as a 10x spike one way only. A slow link is slow both
            # ways, so only a pair whose two measurers agree is called high latency.
            back = pairs.get((b, a))
            if a < b and high(lk.rtt_s) and back is not None and high(back.rtt_s):
                lines.append(f"high latency {_short(a)} <-> {_short(b)}: {fmt_rtt(lk.rtt_s)} "
                             f"and {fmt_rtt(back.rtt_s)} (median {fmt_rtt(med)})")
    return lines


def member_name(m: Mapping[str, Any]) -> str:
    """A member's gossiped name (its profile's `name` label), or '-'."""
    prof = m.get("profile")
    labels = prof.get("labels") if isinstance(prof, Mapping) else None
    name = labels.get("name") if isinstance(labels, Mapping) else None
    return str(name) if isinstance(name, str) and name else "-"


def _stale(text: str, m: Mapping[str, Any]) -> str:
    """A figure of a member that is not alive: what the link did, not what it does."""
    return text if m.get("state") == "alive" or text == "-" else f"{text} (stale)"


def quorum_line(view: Mapping[str, Any]) -> str | None:
    """Plain words when this node sees no quorum, and what to run."""
    if view.get("has_quorum", True):
        return None
    members = view.get("members", [])
    voters = [m for m in members if m.get("state") != "left"]
    alive = [m for m in voters if m.get("state") in ("alive", "suspect")]
    need = len(voters) // 2 + 1
    dead = [m["node_id"] for m in voters if m.get("state") == "dead"]
    out = (f"NO QUORUM: this node reaches {len(alive)} of {len(voters)} members and needs "
           f"{need}, so there is no working scheduler. If the other members are only "
           "unreachable, fix the network and the cluster recovers by itself.")
    if dead:
        out += (" If they are gone for good, remove them (one command each): "
                + "; ".join(f"fusionctl remove {d}" for d in dead))
    return out


def _node_profile(raw: Any) -> NodeProfile | None:
    """The daemon's `profile` (its JSON form: the NodeProfile's fields), or None when it has
    none or an unreadable one."""
    if not isinstance(raw, Mapping) or not raw:
        return None
    try:
        prof = NodeProfile.from_wire(dict(raw))
    except RemoteProtocolError:
        return None
    return prof if isinstance(prof, NodeProfile) else None


def device_line(d: DeviceProfile) -> str:
    """One accelerator of a profile, as `fusionctl status` shows it."""
    gib = 2.0**30
    head = (f"{d.device} {d.name or '?'}, {d.free_bytes / gib:.1f} of "
            f"{d.memory_bytes / gib:.1f} GiB free")
    if d.error:
        return f"{head}: NOT USED: {d.error}"
    mm = d.flop_per_s.get("matmul", 0.0)
    rates = f"{mm / 1e12:.1f} TFLOP/s fp32 matmul"
    if d.matmul_bf16_flop_per_s > 0:
        rates += f", {d.matmul_bf16_flop_per_s / 1e12:.1f} bf16"
    if d.h2d_bytes_per_s > 0:
        rates += f", host->device {d.h2d_bytes_per_s / 1e9:.1f} GB/s"
    return f"{head}, {rates}"


def render_status(data: Mapping[str, Any]) -> None:
    c = _console()
    node = data.get("node", {})
    view = data.get("cluster")
    prof = _node_profile(node.get("profile"))
    c.print(f"node       {node.get('node_id')} ({node.get('name')})  "
            f"{node.get('phase')}  {node.get('security')} links")
    c.print(f"address    {fmt_addr(node.get('address'))}")
    c.print(f"cluster    {node.get('cluster_id') or '(none)'}")
    if prof is not None:
        speed = f"{prof.gflops:.1f} GFLOP/s" if prof.gflops > 0 else "speed not measured"
        c.print(f"device     {prof.device_kind} {prof.device_name}, {speed}, "
                f"torch {prof.torch_version or None}")
        for d in prof.devices:
            c.print(f"gpu        {device_line(d)}")
        if prof.device_error:
            c.print(f"WARNING    this machine's GPU is not used: {prof.device_error}")
    if data.get("warning"):
        c.print(f"WARNING    {data['warning']}")
    software = data.get("software")
    software = software if isinstance(software, Mapping) else {}
    if software.get("warning"):
        c.print(f"WARNING    {software['warning']}")
    if node.get("denied"):
        c.print(f"refusing   {', '.join(node['denied'])} (removed)")
    if view is None:
        c.print("scheduler  (none)")
        c.print("peers      (none)")
        if data.get("hint"):
            c.print(f"\n{data['hint']}")
        return
    leader = view.get("leader")
    role = " (this node)" if leader and leader == node.get("node_id") else ""
    c.print(f"scheduler  {leader or '(none)'}{role}  term {view.get('term', 0)}")
    if "voters" in view:
        c.print(f"quorum     {'yes' if view.get('has_quorum') else 'NO'} "
                f"({view.get('alive_voters')} of {view.get('voters')} voters alive, "
                f"{view.get('needed')} needed)")
    q = quorum_line(view)
    if q:
        c.print(f"\n{q}\n")
    peers = [m for m in view.get("members", []) if m.get("node_id") != node.get("node_id")]
    if not peers:
        c.print("peers      (none)")
    else:
        t = Table(box=None, pad_edge=False, show_edge=False)
        for col in ("PEER", "NAME", "ADDRESS", "SOURCE", "RTT", "BANDWIDTH", "ROLE", "STATE"):
            t.add_column(col, no_wrap=True)
        for m in sorted(peers, key=lambda m: (member_name(m), str(m.get("node_id")))):
            t.add_row(str(m.get("node_id")), member_name(m), fmt_addr(m.get("address")),
                      str(m.get("source") or "-"), _stale(fmt_rtt(m.get("rtt_s")), m),
                      _stale(fmt_bw(m.get("bandwidth_bits_per_s")), m),
                      str(m.get("role") or "-"), str(m.get("state") or "-"))
        c.print(t)
    rows = software.get("nodes") or []
    if rows:
        c.print("\nsoftware")
        t = Table(box=None, pad_edge=False, show_edge=False)
        for col in ("NODE", "TORCH", "PYTHON", "FUSIOND", "OPS"):
            t.add_column(col, no_wrap=True)
        for r in rows:
            t.add_row(str(r.get("node_id")), str(r.get("torch") or "-"),
                      str(r.get("python") or "-"), str(r.get("fusiond") or "-"), fmt_ops(r))
        c.print(t)
    h = health(view, str(node.get("node_id")))
    c.print("\nhealth")
    if not h:
        c.print("  all members alive, no slow links")
    for line in h:
        c.print(f"  {line}")


def render_links(data: Mapping[str, Any]) -> None:
    c = _console()
    members = [str(m) for m in data.get("members", [])]
    pairs = link_pairs(data.get("links"))
    if not members or not pairs:
        c.print("links (none measured yet)")
        return
    cells: tuple[tuple[str, Callable[[LinkRow], str]], ...] = (
        ("bandwidth ± the spread of its probe round (row -> column)",
         lambda lk: fmt_bw_spread(lk.bandwidth_bits_per_s, lk.bandwidth_spread_ratio)),
        ("RTT (row -> column)", lambda lk: fmt_rtt(lk.rtt_s)),
        ("age of the measurement (row -> column)", lambda lk: fmt_age(lk.age_s)),
    )
    for title, fmt in cells:
        c.print(title)
        t = Table(box=None, show_edge=False)
        t.add_column("", no_wrap=True)
        for m in members:
            t.add_column(_short(m, 12), no_wrap=True, justify="right")
        for a in members:
            row = [_short(a, 12)]
            for b in members:
                row.append("·" if a == b else fmt(pairs[(a, b)]) if (a, b) in pairs else "-")
            t.add_row(*row)
        c.print(t)
        c.print()


def _si_bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def render_jobs(data: Mapping[str, Any]) -> None:
    """`fusionctl jobs`: the jobs submitted here, then the stages hosted here."""
    c = _console()
    t = Table(title=f"jobs submitted to {_short(data.get('node_id'), 40)}")
    for col in ("job", "state", "step", "loss", "stages", "output"):
        t.add_column(col)
    for j in data.get("jobs", []):
        loss = j.get("loss")
        # a record from before the daemon's restart may lack live figures
        t.add_row(str(j.get("job_id")), str(j.get("state")),
                  f"{j.get('step') or 0}/{j.get('steps') or '?'}",
                  "-" if loss is None else f"{loss:.4f}", str(j.get("stages") or "-"),
                  str(j.get("output") or "-"))
    c.print(t)
    if data.get("hidden"):
        c.print(f"({data['hidden']} jobs of other users not shown: only root and the daemon's "
                "user see every job)")
    cluster = data.get("cluster")
    if isinstance(cluster, Mapping):
        t = Table(title=f"jobs the scheduler {_short(cluster.get('scheduler'), 40)} runs "
                        "(submitted on any member)")
        for col in ("job", "state", "step", "loss", "stages", "submitted on"):
            t.add_column(col)
        for j in cluster.get("jobs") or []:
            loss = j.get("loss")
            t.add_row(str(j.get("job_id")), str(j.get("state")),
                      f"{j.get('step') or 0}/{j.get('steps') or '?'}",
                      "-" if loss is None else f"{loss:.4f}", str(j.get("stages") or "-"),
                      _short(j.get("submitter"), 40))
        c.print(t)
    elif data.get("cluster_note"):
        c.print(f"(other members' jobs: {data['cluster_note']})")
    stages = data.get("stages", [])
    if stages:
        s = Table(title="stages hosted here")
        for col in ("job", "stage", "scheduler", "running", "steps done"):
            s.add_column(col)
        for x in stages:
            s.add_row(x["job_id"], str(x["stage"]), _short(x["scheduler"], 40),
                      str(x["running"]), str(x["steps_done"]))
        c.print(s)


def render_job(d: Mapping[str, Any]) -> None:
    """`fusionctl job ID`: state, the plan, per-stage and per-link live figures."""
    c = _console()
    st = d.get("status") or {}
    h = d["history"][-1] if d.get("history") else {}
    rate = (f"{h['tokens_per_s']:,.0f} tokens/s" if h.get("tokens_per_s")
            else f"{h['samples_per_s']:,.1f} samples/s" if h.get("samples_per_s") else "-")
    loss = "-" if d.get("loss") is None else f"{d['loss']:.4f}"
    first = "-" if d.get("first_loss") is None else f"{d['first_loss']:.4f}"
    eta = "-" if d.get("eta_s") is None else f"{d['eta_s']:.0f}s"
    c.print(f"job {d['job_id']} ({d['name']}): {d['state']}, step {d['step']}/{d['steps']}, "
            f"loss {first} -> {loss}, {rate}, ETA {eta}, output {d['output']}")
    held = next(((r["held_out_loss"], r.get("step")) for r in reversed(d.get("history") or [])
                 if r.get("held_out_loss") is not None),
                (st.get("held_out_loss"), st.get("held_out_step")))
    if held[0] is not None:
        after = "" if held[1] is None else f" after step {int(held[1]) + 1}"
        c.print(f"held-out loss {float(held[0]):.4f}{after} (the job's held-out split)",
                markup=False)
    if d.get("via_scheduler"):
        c.print(f"submitted on {d.get('submitter')}; as its scheduler {d['via_scheduler']} "
                "reports it (outputs: `fusionctl fetch` on the submitting member)",
                markup=False)
    outcome = d.get("outcome") or {}
    if outcome.get("failure"):
        c.print(f"[red]{outcome['failure']}[/red]", markup=True)
    stored = d.get("outputs") or {}
    if stored:
        c.print("stored by the daemon (`fusionctl fetch " + str(d["job_id"]) + "`): "
                + ", ".join(f"{n} ({_si_bytes(v.get('size_bytes'))})"
                            for n, v in stored.items()), markup=False)
    for name, why in (d.get("unstored") or {}).items():
        c.print(f"not stored: {name}: {why}", markup=False)
    render_plan(d, c)
    s = Table(title="stages")
    for col in ("stage", "machine", "busy", "waiting"):
        s.add_column(col)
    for x in st.get("stages", []):
        busy, wait = x.get("busy"), x.get("wait")
        s.add_row(str(x["stage"]), str(x["node"]), "-" if busy is None else f"{busy:.0%}",
                  "-" if wait is None else f"{wait:.0%}")
    c.print(s)
    e = Table(title="links (cut edges)")
    for col in ("edge", "stages", "codec", "wire fwd", "wire bwd", "dense fwd", "dense bwd"):
        e.add_column(col)
    for x in st.get("edges", []):
        w, dn = x.get("wire_bytes", {}), x.get("dense_bytes", {})
        dens = x.get("density")
        codec = ("int8" if x.get("encoding") == "int8" else
                 "exact" if dens in (None, 1.0) else f"top-k {dens:g}")
        e.add_row(x["edge"], f"{x['src']}->{x['dst']}", codec,
                  _si_bytes(w.get("forward")), _si_bytes(w.get("backward")),
                  _si_bytes(dn.get("forward")), _si_bytes(dn.get("backward")))
    c.print(e)


def _ms(s: Any) -> str:
    return "-" if s is None else f"{float(s) * 1e3:.2f}"


def _codec(link: Mapping[str, Any]) -> str:
    """A link's codec ("exact", "top-k 0.1", "int8", ...); a plan from an older scheduler
    carries only its top-k density."""
    codec = link.get("codec")
    if isinstance(codec, str) and codec:
        return codec
    d = float(link.get("density") or 1.0)
    return "exact" if d >= 1.0 else f"top-k {d:.3g}"


def _mbit(bytes_per_s: Any) -> str:
    if not bytes_per_s:
        return "-"
    mbit = float(bytes_per_s) * 8 / 1e6
    return f"{mbit:,.0f}" if mbit >= 100 else f"{mbit:.3g}"


def _fitted(title: str, columns: list[tuple[str, int | None]], rows: list[list[str]]) -> Table:
    """A table whose figures never shrink: each column is (header, max width of a name
    column that may be cut with an ellipsis, or None for a figure kept whole)."""
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
              padding=(0, 1), collapse_padding=True, show_edge=False)
    for i, (name, cut_at) in enumerate(columns):
        if cut_at is None:
            widest = max([len(name), *(len(r[i]) for r in rows)])
            t.add_column(name, justify="right", no_wrap=True, min_width=widest)
        else:
            t.add_column(name, overflow="ellipsis", no_wrap=True, max_width=cut_at)
    for r in rows:
        t.add_row(*r)
    return t


def render_plan(data: Mapping[str, Any], console: Console | None = None) -> None:
    """The planner's plan (`plan_summary`, as `fusionctl plan` / `submit` / `job` get it):
    stages with their replicas, the busiest links with their densities, the gradient
    reductions, the prediction and why machines stay idle, in tables that fit the console.
    A job cut by hand (`--stages`) has no plan: its stage list, as the daemon wrote it."""
    c = console or _console()
    p = data.get("plan_summary")
    if not isinstance(p, Mapping) or not p.get("stages"):
        c.print(str(data.get("plan") or ""), markup=False, highlight=False)
        return
    stages = list(p.get("stages") or [])
    used = sum(1 + len(s.get("replica_machine_ids") or []) for s in stages)
    head = (f"plan {p.get('method', '?')}"
            + (f" for {p['graph_name']!r}" if p.get("graph_name") else "")
            + f": {len(stages)} stages on {used} of {len(p.get('machines') or [])} machines")
    if p.get("micro_batch_size"):
        head += (f"; micro-batch {p['micro_batch_size']} x {p.get('num_micro_batches')} "
                 f"({p.get('schedule')})")
    c.print(head, markup=False)
    replicated = any(s.get("replica_machine_ids") for s in stages)
    n_stages = len(stages)

    def ahead(s: Mapping[str, Any]) -> bool:
        # more micro-batches in flight than 1F1B's own min(M, S - i): a slow link's round trip
        micro = list(s.get("micro_batches") or [0])
        return (p.get("schedule") == "1f1b" and int(s.get("in_flight") or 0)
                > min(int(micro[0]), n_stages - int(s.get("stage") or 0)))

    mbs = int(p.get("micro_batch_size") or 0)
    # replicas in micro-batches of their own sizes (the plan's `samples` per machine)
    sized = any(list(s.get("samples") or []) != [int(k) * mbs for k in s.get("micro_batches")
                                                   or []] for s in stages
                if s.get("samples") and s.get("replica_machine_ids"))
    rows: list[list[str]] = []
    for s in stages:
        micro = list(s.get("micro_batches") or [])
        samples = list(s.get("samples") or [])
        for i, machine in enumerate([s.get("machine_id"), *(s.get("replica_machine_ids") or [])]):
            row = [str(s.get("stage")) if i == 0 else "+", str(machine)]
            row += ([str(int(s.get("stop_op", 0)) - int(s.get("start_op", 0))),
                     f"{s.get('first_op', '')} -> {s.get('last_op', '')}", _ms(s.get("compute_s")),
                     f"{_si_bytes(s.get('memory_bytes'))} / {_si_bytes(s.get('memory_cap_bytes'))}"
                     + (" R" if s.get("recompute") else "")
                     + (f" C{len(s.get('checkpoint_blocks') or [])}/{s.get('blocks')}"
                        if s.get("checkpoint_blocks") else "")
                     + (" D" if s.get("offload") else "")
                     + (" W" if s.get("offload_params") else "")
                     + (f" F{s.get('in_flight')}" if ahead(s) else "")]
                    if i == 0 else ["", "(replica)", "", ""])
            if replicated:
                row.append((str(micro[i]) if i < len(micro) else "-")
                           + (f" ({samples[i]})" if sized and i < len(samples) else ""))
            rows.append(row)
    title = "stages (+: a replica, on its share of the micro-batches)" if replicated else "stages"
    if any(s.get("recompute") for s in stages):
        title += " (R: recomputes its activations in the backward, they would not fit kept)"
    if any(s.get("checkpoint_blocks") for s in stages):
        title += " (Ck/n: recomputes k of its n blocks in the backward)"
    if any(s.get("offload") for s in stages):
        title += " (D: its optimizer state on disk, it would not fit in memory)"
    if any(s.get("offload_params") for s in stages):
        title += " (W: its weights on disk too)"
    if any(ahead(s) for s in stages):
        title += (" (Fk: k micro-batches in flight, more than 1F1B's own, so a slow link's "
                  "round trip does not leave it waiting)")
    c.print(_fitted(title,
                    [("stage", None), ("machine", 16), ("ops", None),
                     ("first op -> last op", 30), ("ms", None), ("memory / of", None)]
                    + ([("micro-b. (samples)" if sized else "micro-b.", None)]
                       if replicated else []), rows))
    links = sorted(p.get("links") or [], key=lambda lk: -float(lk.get("dense_time_s")
                                                              or lk.get("time_s") or 0))
    shown = [lk for lk in links if float(lk.get("time_s") or 0) >= 1e-5
             or float(lk.get("fwd_bytes") or 0) + float(lk.get("bwd_bytes") or 0) >= 1e4][:12]
    if shown:
        rows = []
        for lk in shown:
            wire_mb = (float(lk.get("fwd_bytes") or 0) + float(lk.get("bwd_bytes") or 0)) / 1e6
            rows.append([f"{lk.get('src_stage')}:{_short(lk.get('src_machine_id'), 10)} -> "
                         f"{lk.get('dst_stage')}:{_short(lk.get('dst_machine_id'), 10)}",
                         _mbit(lk.get("bandwidth_fwd_bytes_per_s")), f"{wire_mb:.3g}",
                         _codec(lk), _ms(lk.get("time_s")),
                         _ms(lk.get("dense_time_s", lk.get("time_s")))])
        c.print(_fitted("links (per micro-batch; the busiest first)",
                        [("link", 28), ("Mbit/s", None), ("wire MB", None), ("codec", None),
                         ("ms", None), ("dense ms", None)], rows))
        if len(links) > len(shown):
            c.print(f"({len(links) - len(shown)} more links carry less)", markup=False)
    syncs = list(p.get("syncs") or [])
    if syncs:
        rows = []
        for x in syncs:
            time_s, exposed_s = float(x.get("time_s") or 0), float(x.get("exposed_s") or 0)
            sent_mb = float(x.get("grad_bytes") or 0) * float(x.get("density") or 1) / 1e6
            rows.append([str(x.get("stage")), str(len(x.get("machine_ids") or [])),
                         f"{sent_mb:.3g}", f"{float(x.get('density') or 1.0):.3f}",
                         _mbit(x.get("slowest_bytes_per_s")), str(x.get("buckets") or 1),
                         _ms(time_s), _ms(time_s - exposed_s), str(x.get("scheme", ""))])
        c.print(_fitted("gradient reductions (per iteration)",
                        [("stage", None), ("replicas", None), ("MB", None), ("density", None),
                         ("slowest Mbit/s", None), ("buckets", None), ("ms", None),
                         ("hidden ms", None), ("scheme", 12)], rows))
    if p.get("bottleneck"):
        c.print(f"bottleneck: {p['bottleneck']} ({_ms(p.get('bottleneck_s'))} ms per "
                f"micro-batch; compute bottleneck {_ms(p.get('compute_bottleneck_s'))} ms)",
                markup=False)
    if p.get("iteration_s") is not None:
        parts = [f"fill {float(p.get('fill_s') or 0):.4g} s",
                 f"optimizer {float(p.get('optimizer_s') or 0):.3g} s",
                 f"tied-weight sync {float(p.get('sync_s') or 0):.3g} s"]
        if syncs:
            parts.append(f"gradient reduction {float(p.get('grad_sync_s') or 0):.3g} s "
                         "(not hidden)")
        c.print(f"iteration: {float(p['iteration_s']):.4g} s (" + ", ".join(parts) + ")",
                markup=False)
        gain = p.get("adatopk_gain")
        c.print(f"throughput: {float(p.get('samples_per_s') or 0):.4g} samples/s"
                + (f"; AdaTopK gain {float(gain):.2f}x over the same cut dense"
                   if gain else ""), markup=False)
    for key, what in (("over_memory", "OVER MEMORY on"), ("unrunnable", "CANNOT RUN")):
        if p.get(key):
            c.print(f"{what}: " + "; ".join(str(x) for x in p[key]), markup=False)
    idle = p.get("idle") or {}
    if idle:
        by_reason: dict[str, list[str]] = {}
        for m, why in sorted(idle.items()):
            by_reason.setdefault(str(why), []).append(str(m))
        c.print("idle machines:", markup=False)
        for why, ms in by_reason.items():
            names = ", ".join(ms) if len(ms) <= 6 else f"{', '.join(ms[:5])}, ... ({len(ms)})"
            c.print(f"  {names}: {why}", markup=False)
    for n in p.get("notes") or []:
        c.print(f"note: {n}", markup=False)
