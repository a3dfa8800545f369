"""fusionctl's job commands: submit, plan, jobs, job, cancel, logs.

`submit` and `plan` capture the model HERE (`fusiond.jobs.submit.prepare_job`: the only place
user code runs) and upload the IR and initial weights to the local daemon; nothing of the
user's code leaves this machine. `submit` then follows the job until it ends (unless
``--detach``) and its exit code is the job's outcome.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from fusionctl.client import ApiFailure, Client, Unreachable

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_JOB_FAILED = 5
EXIT_JOB_CANCELLED = 6
POLL_S = 0.5


def add_parsers(cmd: Any) -> None:
    """Register the job subcommands (`cmd(name, help, read)` makes one)."""
    for name, helptext in (("submit", "capture a job here, send it to the cluster, follow it"),
                           ("plan", "capture a job here and print the planner's table; runs "
                                    "nothing")):
        sp = cmd(name, helptext, read=True)
        sp.add_argument("job", metavar="JOB.toml", help="the job file (docs/jobs.md)")
        sp.add_argument("--stages", type=int, default=None, metavar="N",
                        help="cut the model evenly over N machines (this one first) instead of "
                             "letting the planner choose")
        sp.add_argument("--steps", type=int, default=None, metavar="N",
                        help="override job.steps")
        sp.add_argument("--resume", default=None, metavar="FILE.safetensors",
                        help="start from a checkpoint-N.safetensors of an earlier run of this "
                             "job (at step N), or from a model.safetensors (at step 0)")
        if name == "submit":
            sp.add_argument("--detach", action="store_true",
                            help="return once the job started (exit 0) instead of following it")
    cmd("jobs", "jobs submitted to this daemon, and stages it hosts", read=True)
    sp = cmd("job", "one job: plan, state, per-stage and per-link live figures", read=True)
    sp.add_argument("id", metavar="ID")
    sp = cmd("cancel", "stop a job: every partition stops and frees its memory", read=True)
    sp.add_argument("id", metavar="ID")
    sp = cmd("logs", "a job's log lines (progress, failures, outputs)", read=True)
    sp.add_argument("id", metavar="ID")
    sp.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")


def _info(text: str) -> None:
    from rich.console import Console

    c = Console(stderr=True, highlight=False)
    if not c.is_terminal:  # piped: never wrap the plan's wide table
        c = Console(stderr=True, highlight=False, width=240)
    c.print(text, markup=False)


def _prepare(ns: argparse.Namespace) -> bytes | None:
    """Validate and capture the job here; None (after printing why) if it is refused."""
    from fusiond.errors import FusionError
    from fusiond.graph import state_to_bytes
    from fusiond.jobs.submit import prepare_job, resume_state
    from fusiond.jobs.upload import encode_upload

    if ns.stages is not None and ns.stages < 1:
        print(f"fusionctl {ns.cmd}: --stages must be >= 1", file=sys.stderr)
        return None
    if not Path(ns.job).is_file():
        print(f"fusionctl {ns.cmd}: job refused: {ns.job}: no such file", file=sys.stderr)
        return None
    try:
        with warnings.catch_warnings():
            # torch.export's deprecation chatter is not the user's business.
            warnings.simplefilter("ignore", FutureWarning)
            job = prepare_job(ns.job)
    except (FusionError, OSError, ValueError) as e:
        print(f"fusionctl {ns.cmd}: job refused: {e}", file=sys.stderr)
        return None
    if not ns.json:
        _info(f"captured {job.spec.name}: {len(job.captured.graph.nodes)} ops, "
              f"{len(job.state_bytes) / 1e6:.1f} MB of weights in {job.prepare_s:.1f}s")
    meta: dict[str, Any] = {"toml": job.toml_text, "base": job.base, "out_base": job.out_base}
    state_bytes = job.state_bytes
    if ns.resume is not None:
        try:
            state, first = resume_state(job.captured, ns.resume)
        except FusionError as e:
            print(f"fusionctl {ns.cmd}: --resume refused: {e}", file=sys.stderr)
            return None
        steps = ns.steps if ns.steps is not None else job.spec.steps
        if first >= steps:
            print(f"fusionctl {ns.cmd}: --resume refused: {ns.resume} follows step {first} and "
                  f"the job has {steps} steps; train longer with --steps N (N > {first})",
                  file=sys.stderr)
            return None
        state_bytes = state_to_bytes(state)
        meta["first_step"] = first
        if not ns.json:
            _info(f"resuming from {ns.resume} at step {first}" if first else
                  f"starting from the weights in {ns.resume} (no step: a new run)")
    if ns.stages is not None:
        meta["stages"] = ns.stages
    if ns.steps is not None:
        meta["steps"] = ns.steps
    return encode_upload(meta, job.graph_bytes, state_bytes)


def _upload_client(c: Client) -> Client:
    # Planning and validating a big model take longer than a status request.
    return Client(c.endpoint, timeout=max(c.timeout, 300.0))


def plan(c: Client, ns: argparse.Namespace, out: Any) -> int:
    body = _prepare(ns)
    if body is None:
        return EXIT_FAILED
    try:
        data = _upload_client(c).request("POST", "/v1/jobs?dry_run=1", raw=body)
    except ApiFailure as e:
        print(f"fusionctl plan: job refused by the cluster: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    out.result(data, lambda: print(data["plan"]))
    return EXIT_OK


def submit(c: Client, ns: argparse.Namespace, out: Any) -> int:
    body = _prepare(ns)
    if body is None:
        return EXIT_FAILED
    try:
        data = _upload_client(c).request("POST", "/v1/jobs", raw=body)
    except ApiFailure as e:
        print(f"fusionctl submit: job refused by the cluster: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    job_id = data["job_id"]
    if ns.detach:
        out.result(data, lambda: print(
            f"{job_id}\n\nfollow it:\n  fusionctl job {job_id}\n  fusionctl logs {job_id}"))
        return EXIT_OK
    if not ns.json:
        _info(data["plan"])
        _info(f"job {job_id} started: {data['steps']} steps on {len(data['stages'])} "
              f"machines (Ctrl-C stops following; `fusionctl cancel {job_id}` stops the job)")
    try:
        final = follow(c, job_id, quiet=ns.json)
    except KeyboardInterrupt:
        print(f"\nstopped following; the job runs on. `fusionctl job {job_id}`, "
              f"`fusionctl cancel {job_id}`", file=sys.stderr)
        return EXIT_FAILED
    out.result(final, lambda: print(_outcome_text(final)))
    return {"done": EXIT_OK, "cancelled": EXIT_JOB_CANCELLED}.get(final["state"],
                                                                   EXIT_JOB_FAILED)


def _outcome_text(d: dict[str, Any]) -> str:
    o = d.get("outcome") or {}
    if d["state"] == "done":
        loss = (f"loss {o['first_loss']:.4f} -> {o['final_loss']:.4f}"
                if o.get("first_loss") is not None and o.get("final_loss") is not None else "")
        outs = "; ".join(f"{k} {v}" for k, v in (d.get("outputs") or {}).items())
        return f"job {d['job_id']} done in {o.get('wall_s', 0.0):.1f}s: {loss}\n{outs}"
    return f"job {d['job_id']} {d['state']}: {o.get('failure') or '(no report)'}"


def _rate(h: dict[str, Any]) -> str:
    if h.get("tokens_per_s"):
        return f"{h['tokens_per_s']:,.0f} tok/s"
    if h.get("samples_per_s"):
        return f"{h['samples_per_s']:,.1f} samples/s"
    return "-"


def follow(c: Client, job_id: str, *, quiet: bool = False) -> dict[str, Any]:
    """Poll the job until it ends, showing progress on stderr; returns its last status."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = Console(stderr=True, highlight=False)
    live = console.is_terminal and not quiet
    bar: Progress | None = None
    task: Any = None
    last_print = 0.0
    misses = 0
    while True:
        try:
            d = c.get(f"/v1/jobs/{job_id}?history=1")
            misses = 0
        except Unreachable:
            misses += 1  # a busy daemon may miss one poll; a dead one many
            if misses > 20:
                raise
            time.sleep(POLL_S)
            continue
        h = d["history"][-1] if d["history"] else {}
        loss = "-" if h.get("loss") is None else f"{h['loss']:.4f}"
        eta = "-" if d.get("eta_s") is None else f"{d['eta_s']:.0f}s"
        fields = {"loss": loss, "rate": _rate(h), "eta": eta}
        if live:
            if bar is None:
                bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                               MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                               TextColumn("{task.fields[rate]}"),
                               TextColumn("ETA {task.fields[eta]}"), console=console)
                bar.start()
                task = bar.add_task(d["name"], total=d["steps"], loss=loss,
                                    rate=fields["rate"], eta=eta)
            bar.update(task, completed=d["step"], loss=loss, rate=fields["rate"], eta=eta)
        elif not quiet and (time.monotonic() - last_print > 5.0 or d["state"] != "running"):
            last_print = time.monotonic()
            print(f"step {d['step']}/{d['steps']}  loss {loss}  {fields['rate']}  ETA {eta}",
                  file=sys.stderr)
        if d["state"] != "running":
            if bar is not None:
                bar.stop()
            return d
        time.sleep(POLL_S)


def list_jobs(c: Client, ns: argparse.Namespace, out: Any) -> int:
    data = c.get("/v1/jobs")

    def human() -> None:
        from fusionctl.render import render_jobs

        render_jobs(data)

    out.result(data, human)
    return EXIT_OK


def show_job(c: Client, ns: argparse.Namespace, out: Any) -> int:
    data = c.get(f"/v1/jobs/{ns.id}?history=5")

    def human() -> None:
        from fusionctl.render import render_job

        render_job(data)

    out.result(data, human)
    return EXIT_OK


def cancel(c: Client, ns: argparse.Namespace, out: Any) -> int:
    data = c.post(f"/v1/jobs/{ns.id}/cancel")
    out.result(data, lambda: print(
        f"job {data['job_id']} cancelled" if data["cancelled"]
        else f"job {data['job_id']} already {data['state']}; nothing to cancel"))
    return EXIT_OK


def logs(c: Client, ns: argparse.Namespace, out: Any) -> int:
    seen = 0
    while True:
        data = c.get(f"/v1/jobs/{ns.id}/logs")
        lines = data["lines"]
        if ns.json:
            out.result(data, lambda: None)
            return EXIT_OK
        for line in lines[seen:]:
            print(line)
        seen = len(lines)
        if not ns.follow or c.get(f"/v1/jobs/{ns.id}?history=0")["state"] != "running":
            return EXIT_OK
        time.sleep(1.0)
