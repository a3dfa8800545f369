"""fusionctl's job commands: submit, plan, jobs, job, cancel, logs, fetch.

`submit` and `plan` capture the model HERE (`fusiond.jobs.submit.prepare_job`: the only place
user code runs), read the job's data HERE, as the user (`corpus_for_upload`: the daemon never
opens a path named in a job), and upload the IR, the initial weights and the data to the local
daemon; nothing of the user's code leaves this machine. `submit` then follows the job until it
ends (unless ``--detach``), downloads its checkpoints as they appear and its outputs at the
end, and writes them at the job's output path as the user (`fusionctl.outputs`); its exit
code is the job's outcome, or 7 when the outputs could not be written here. `fetch ID` writes
them later (after ``--detach``, or after a failed write).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from fusionctl.client import ApiFailure, Client, Unreachable
from fusionctl.render import _console, render_plan

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_JOB_FAILED = 5
EXIT_JOB_CANCELLED = 6
EXIT_OUTPUTS = 7
EXIT_INTERRUPTED = 130
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
        sp.add_argument("--replicas", type=int, default=None, metavar="R",
                        help="with --stages: run every stage on R machines (data "
                             "parallelism; N x R machines), each on its share of the "
                             "micro-batches")
        sp.add_argument("--steps", type=int, default=None, metavar="N",
                        help="override job.steps")
        sp.add_argument("--resume", default=None, metavar="FILE.safetensors",
                        help="start from a checkpoint-N.safetensors of an earlier run of this "
                             "job (at step N), or from a model.safetensors (at step 0)")
        if name == "submit":
            sp.add_argument("--detach", action="store_true",
                            help="return once the job started (exit 0) instead of following "
                                 "it; `fusionctl fetch ID` writes its outputs later")
            sp.add_argument("--force", action="store_true",
                            help="replace the outputs of an earlier run in job.output")
    cmd("jobs", "jobs submitted to this daemon, and stages it hosts", read=True)
    sp = cmd("job", "one job: plan, state, per-stage and per-link live figures", read=True)
    sp.add_argument("id", metavar="ID")
    sp = cmd("cancel", "stop a job: every partition stops and frees its memory", read=True)
    sp.add_argument("id", metavar="ID")
    sp = cmd("logs", "a job's log lines (progress, failures, outputs)", read=True)
    sp.add_argument("id", metavar="ID")
    sp.add_argument("-f", "--follow", action="store_true",
                    help="keep printing until it ends, with the progress bar on a terminal")
    sp = cmd("fetch", "write a job's outputs (model, metrics, checkpoints) here, as you",
             read=True)
    sp.add_argument("id", metavar="ID")
    sp.add_argument("--output", default=None, metavar="DIR",
                    help="write them in DIR (default: the job's output directory)")
    sp.add_argument("--force", action="store_true",
                    help="replace files that exist there with other content")


def _info(text: str) -> None:
    from rich.console import Console

    c = Console(stderr=True, highlight=False)
    if not c.is_terminal:  # piped: never wrap the plan's wide table
        c = Console(stderr=True, highlight=False, width=240)
    c.print(text, markup=False)


def _prepare(ns: argparse.Namespace) -> tuple[bytes, Any] | None:
    """Validate and capture the job, and read its data, here, as the user; (the upload, the
    spec), or None (after printing why) if it is refused."""
    from fusiond.errors import FusionError
    from fusiond.graph import state_to_bytes
    from fusiond.jobs.submit import corpus_for_upload, prepare_job, resume_state
    from fusiond.jobs.upload import encode_upload

    if ns.stages is not None and ns.stages < 1:
        print(f"fusionctl {ns.cmd}: --stages must be >= 1", file=sys.stderr)
        return None
    if ns.replicas is not None and (ns.replicas < 1 or ns.stages is None):
        print(f"fusionctl {ns.cmd}: --replicas takes R >= 1 and goes with --stages N",
              file=sys.stderr)
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
    if ns.replicas is not None:
        meta["replicas"] = ns.replicas
    if ns.steps is not None:
        meta["steps"] = ns.steps
    if ns.cmd == "submit" and not _output_allowed(ns, job.spec.output):
        return None
    try:  # the data, read here with this user's permissions, travels with the upload
        digest, corpus = corpus_for_upload(job.spec)
    except (FusionError, OSError, ValueError) as e:
        print(f"fusionctl {ns.cmd}: job refused: cannot read the job's data: {e}",
              file=sys.stderr)
        return None
    meta["data_digest"] = digest
    meta["data_default"] = bool(digest) and not corpus
    return encode_upload(meta, job.graph_bytes, state_bytes, corpus), job.spec


def _output_allowed(ns: argparse.Namespace, output: Path) -> bool:
    """Whether `submit` may write its outputs in `output` (printing why not): writable by
    this user, and holding no earlier run's outputs unless --force or resuming from a
    checkpoint in that very directory."""
    from fusionctl.outputs import earlier_outputs, output_problem

    problem = output_problem(output)
    if problem is not None:
        print(f"fusionctl submit: job refused: the outputs go to {output} (job.output), and "
              f"fusionctl cannot write there: {problem}. Set job.output to a directory you "
              "can write", file=sys.stderr)
        return False
    earlier = earlier_outputs(output)
    resuming_here = ns.resume is not None and Path(ns.resume).resolve().parent \
        == output.resolve()
    if earlier and not ns.force and not resuming_here:
        print(f"fusionctl submit: job refused: {output} already holds the outputs of an "
              f"earlier run ({', '.join(earlier[:4])}{', ...' if len(earlier) > 4 else ''}); "
              "pass --force to replace them, or set job.output to another directory",
              file=sys.stderr)
        return False
    return True


def _upload_client(c: Client) -> Client:
    # Planning and validating a big model take longer than a status request.
    return Client(c.endpoint, timeout=max(c.timeout, 300.0))


def plan(c: Client, ns: argparse.Namespace, out: Any) -> int:
    prepared = _prepare(ns)
    if prepared is None:
        return EXIT_FAILED
    body, _ = prepared
    try:
        data = _upload_client(c).request("POST", "/v1/jobs?dry_run=1", raw=body)
    except ApiFailure as e:
        print(f"fusionctl plan: job refused by the cluster: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    out.result(data, lambda: render_plan(data))
    return EXIT_OK


def submit(c: Client, ns: argparse.Namespace, out: Any) -> int:
    from fusionctl.outputs import OutputWriter, WriteFailure

    prepared = _prepare(ns)
    if prepared is None:
        return EXIT_FAILED
    body, spec = prepared
    try:
        data = _upload_client(c).request("POST", "/v1/jobs", raw=body)
    except ApiFailure as e:
        print(f"fusionctl submit: job refused by the cluster: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    del body
    job_id = data["job_id"]
    if ns.detach:
        out.result(data, lambda: print(
            f"{job_id}\n\nfollow it:\n  fusionctl job {job_id}\n  fusionctl logs {job_id}\n"
            f"write its outputs (to {spec.output}) once it ended:\n  fusionctl fetch {job_id}"))
        return EXIT_OK
    if not ns.json:
        render_plan(data, _console(stderr=True))
        _info(f"job {job_id} started: {data['steps']} steps on {len(data['stages'])} "
              f"machines (Ctrl-C stops following; `fusionctl cancel {job_id}` stops the job)")
    writer = OutputWriter(_download_client(c), job_id, spec.output)
    failure: str | None = None

    def checkpoints(d: dict[str, Any]) -> None:
        nonlocal failure
        if failure is not None:
            return
        files = [{"name": k, **v} for k, v in (d.get("outputs") or {}).items()
                 if k.startswith("checkpoint-")]
        try:
            writer.write(files, only_new=True)
        except WriteFailure as e:
            failure = str(e)
        except (ApiFailure, Unreachable) as e:  # pruned meanwhile, or a busy daemon
            if not ns.json:
                _info(f"checkpoint not fetched yet: {e}")

    try:
        final = follow(c, job_id, quiet=ns.json, on_poll=checkpoints)
    except KeyboardInterrupt:
        print(f"\nstopped following; the job runs on. `fusionctl job {job_id}`, "
              f"`fusionctl logs -f {job_id}`, `fusionctl cancel {job_id}`, and once it ended "
              f"`fusionctl fetch {job_id}`", file=sys.stderr)
        return EXIT_INTERRUPTED
    if failure is None:
        try:
            listing = c.get(f"/v1/jobs/{job_id}/outputs")
            writer.write(listing["files"], only_new=True)
        except WriteFailure as e:
            failure = str(e)
        except ApiFailure as e:
            failure = f"could not list the outputs: {e.message}"
    final = {**final, "written": dict(writer.written)}
    code = {"done": EXIT_OK, "cancelled": EXIT_JOB_CANCELLED}.get(final["state"],
                                                                  EXIT_JOB_FAILED)
    if failure is not None:
        final["write_failure"] = failure
        print(f"fusionctl submit: the outputs of job {job_id} were NOT all written: {failure}. "
              f"The daemon keeps them: once that is fixed, run `fusionctl fetch {job_id}` "
              f"(or `fusionctl fetch {job_id} --output DIR`)", file=sys.stderr)
        if code == EXIT_OK:
            code = EXIT_OUTPUTS
    out.result(final, lambda: print(_outcome_text(final)))
    return code


def _download_client(c: Client) -> Client:
    # A model of a few GB streams for a while; each read waits at most this long.
    return Client(c.endpoint, timeout=max(c.timeout, 120.0))


def fetch(c: Client, ns: argparse.Namespace, out: Any) -> int:
    """`fusionctl fetch ID [--output DIR] [--force]`: store again what the daemon could not
    (held weights, metrics), then write every stored output here, as this user."""
    from fusionctl.outputs import OutputWriter, WriteFailure

    try:
        listing = _upload_client(c).request("POST", f"/v1/jobs/{ns.id}/fetch", {})
    except ApiFailure as e:
        if e.status in (403, 404):
            raise
        print(f"fusionctl fetch: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    target = ns.output or listing.get("output")
    if not target:
        print(f"fusionctl fetch: job {ns.id} names no output directory; pass --output DIR",
              file=sys.stderr)
        return EXIT_FAILED
    writer = OutputWriter(_download_client(c), ns.id, Path(target), overwrite=bool(ns.force))
    try:
        wrote = writer.write(listing["files"])
    except WriteFailure as e:
        print(f"fusionctl fetch: job {ns.id}: {e}", file=sys.stderr)
        return EXIT_OUTPUTS
    result = {**listing, "written": dict(writer.written), "new": wrote}
    if not listing["files"]:
        print(f"fusionctl fetch: job {ns.id} has no stored outputs (state {listing['state']})",
              file=sys.stderr)
    out.result(result, lambda: print("\n".join(
        f"{'wrote' if n in wrote else 'have '} {p}" for n, p in writer.written.items())
        or "nothing to write"))
    return EXIT_OK


def _outcome_text(d: dict[str, Any]) -> str:
    o = d.get("outcome") or {}
    outs = "\n".join(f"  {p}" for p in (d.get("written") or {}).values())
    if d["state"] == "done":
        loss = (f"loss {o['first_loss']:.4f} -> {o['final_loss']:.4f}"
                if o.get("first_loss") is not None and o.get("final_loss") is not None else "")
        return f"job {d['job_id']} done in {o.get('wall_s', 0.0):.1f}s: {loss}" + (
            f"\nwritten:\n{outs}" if outs else "")
    if d["state"] == "cancelled":
        return (f"job {d['job_id']} cancelled at step {d.get('step') or 0} of "
                f"{d.get('steps') or '?'} (`fusionctl cancel`)" + (
                    f"\nwritten:\n{outs}" if outs else ""))
    return f"job {d['job_id']} {d['state']}: {o.get('failure') or '(no report)'}" + (
        f"\nwritten:\n{outs}" if outs else "")


def _rate(h: dict[str, Any]) -> str:
    if h.get("tokens_per_s"):
        return f"{h['tokens_per_s']:,.0f} tok/s"
    if h.get("samples_per_s"):
        return f"{h['samples_per_s']:,.1f} samples/s"
    return "-"


def follow(c: Client, job_id: str, *, quiet: bool = False,
           on_poll: Any = None) -> dict[str, Any]:
    """Poll the job until it ends, showing progress on stderr (and handing each status to
    `on_poll`); returns its last status."""
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    live = console.is_terminal and not quiet
    try:
        return _follow(c, job_id, quiet=quiet, on_poll=on_poll, console=console, live=live)
    finally:
        bar = _BARS.pop(job_id, None)
        if bar is not None:  # Ctrl-C mid-poll too: the bar gives the terminal its cursor back
            bar.stop()


_BARS: dict[str, Any] = {}
"""The progress bar of each job `follow` is drawing (so it is stopped however it ends)."""


def _follow(c: Client, job_id: str, *, quiet: bool, on_poll: Any, console: Any,
            live: bool) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

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
                _BARS[job_id] = bar
                task = bar.add_task(d["name"], total=d["steps"], loss=loss,
                                    rate=fields["rate"], eta=eta)
            bar.update(task, completed=d["step"], loss=loss, rate=fields["rate"], eta=eta)
        elif not quiet and (time.monotonic() - last_print > 5.0 or d["state"] != "running"):
            last_print = time.monotonic()
            print(f"step {d['step']}/{d['steps']}  loss {loss}  {fields['rate']}  ETA {eta}",
                  file=sys.stderr)
        if on_poll is not None:
            on_poll(d)
        if d["state"] != "running":
            return d
        time.sleep(POLL_S)


def list_jobs(c: Client, ns: argparse.Namespace, out: Any) -> int:
    data = c.get("/v1/jobs?cluster=1")

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
    """`fusionctl logs ID [-f]`: the job's log lines; with -f, new ones as they come and, on a
    terminal, the progress bar `submit` draws (re-attached after `submit --detach` or a Ctrl-C),
    until the job ends; then the exit code says how (0 done, 5 failed, 6 cancelled)."""
    from rich.console import Console

    seen = 0
    console = Console(stderr=True, highlight=False)
    bar: Any = None
    task: Any = None
    try:
        while True:
            data = c.get(f"/v1/jobs/{ns.id}/logs")
            lines = data["lines"]
            if ns.json:
                out.result(data, lambda: None)
                return EXIT_OK
            for line in lines[seen:]:
                if bar is not None:
                    bar.console.print(line, markup=False, highlight=False)
                else:
                    print(line, flush=True)
            seen = len(lines)
            if not ns.follow:
                return EXIT_OK
            d = c.get(f"/v1/jobs/{ns.id}?history=1")
            if console.is_terminal and d["state"] == "running":
                bar, task = _progress(console, bar, task, d)
            if d["state"] != "running":
                return {"done": EXIT_OK, "cancelled": EXIT_JOB_CANCELLED}.get(
                    d["state"], EXIT_JOB_FAILED)
            time.sleep(1.0)
    finally:
        if bar is not None:  # Ctrl-C too: the terminal gets its cursor back
            bar.stop()


def _progress(console: Any, bar: Any, task: Any, d: dict[str, Any]) -> tuple[Any, Any]:
    """Draw (or move on) the progress bar of job status `d`; (bar, task)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    h = d["history"][-1] if d.get("history") else {}
    loss = "-" if h.get("loss") is None else f"{h['loss']:.4f}"
    eta = "-" if d.get("eta_s") is None else f"{d['eta_s']:.0f}s"
    if bar is None:
        bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                       MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                       TextColumn("{task.fields[rate]}"), TextColumn("ETA {task.fields[eta]}"),
                       console=console)
        bar.start()
        task = bar.add_task(d["name"], total=d["steps"], loss=loss, rate=_rate(h), eta=eta)
    bar.update(task, completed=d["step"], loss=loss, rate=_rate(h), eta=eta)
    return bar, task
