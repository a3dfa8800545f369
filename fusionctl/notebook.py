"""A Python API for notebooks and scripts: train an `nn.Module` you hold on the cluster, follow
it, and get the trained module back, in a few lines.

    from fusionctl.notebook import train

    run = train(MyModel(), data="corpus.txt", steps=200, seq_len=64, lr=3e-3)
    for step in run.follow():          # each step record as it arrives: step, loss, tokens/s
        print(step["step"], step["loss"])
    model = run.result()               # a copy of your module with the trained weights

It is `fusionctl submit` without a job file: the module is captured here (torch.export), as
the user, and only its operator graph and weights go to the daemon, with the data read here
(`docs/jobs.md`); nothing of your code leaves this process. The module must be exportable and
use only ops the cluster runs, as any job's; the data is a text corpus (a file or directory;
byte-level) or a `[data]` table as a dict (`{"kind": "images", ...}`); the default is the
standard library's sources. `examples/notebook.py` is a complete example (a test runs it).
The daemon is the one `fusionctl` would talk to (`FUSION_API_SOCKET`, or `socket=`).
"""

from __future__ import annotations

import copy
import io
import os
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusionctl.client import DEFAULT_SOCKET, Client, ClientError, Endpoint

__all__ = ["JobEnded", "Run", "in_memory_model", "train"]

FACTORY = "fusionctl.notebook:in_memory_model"
"""What the job's `model.factory` names: the module came from this process, not a factory."""
POLL_S = 0.5


class JobEnded(ClientError):
    """The job ended without a trained model (failed or cancelled); the message says how."""


def in_memory_model() -> Any:
    """Stands in a notebook job's `model.factory`: there is no factory to call, the module was
    captured where it lived."""
    raise RuntimeError("this job's model was an in-memory module, captured in the notebook "
                       "that submitted it: rebuild it there (fusionctl.notebook.train)")


def _toml(tables: Mapping[str, Mapping[str, Any]]) -> str:
    from fusiond.config import toml_value

    out = []
    for name, table in tables.items():
        out.append(f"[{name}]")
        for k, v in table.items():
            if isinstance(v, Mapping):
                inner = ", ".join(f"{kk} = {toml_value(vv)}" for kk, vv in v.items())
                out.append(f"{k} = {{ {inner} }}")
            else:
                out.append(f"{k} = {toml_value(v)}")
        out.append("")
    return "\n".join(out)


@dataclass
class Run:
    """A job submitted from here: follow it, wait for it, take its trained module."""

    client: Client
    job_id: str
    model: Any
    """The module as submitted (`result` loads the trained weights into a copy of it)."""
    plan: str = ""
    _seen: int = field(default=-1, repr=False)

    def status(self, history: int = 1) -> dict[str, Any]:
        """What `fusionctl job ID --json` shows."""
        return self.client.get(f"/v1/jobs/{self.job_id}?history={history}")

    def follow(self) -> Iterator[dict[str, Any]]:
        """Each step record (step, loss, lr, wall_s, tokens_per_s, ...) as the job makes it,
        until the job ends (a step redone after a restart comes again)."""
        while True:
            d = self.status(history=1000)
            for h in d.get("history") or []:
                if int(h.get("step", -1)) > self._seen:
                    self._seen = int(h["step"])
                    yield h
            if d["state"] != "running":
                return
            time.sleep(POLL_S)

    def wait(self) -> dict[str, Any]:
        """Block until the job ends; its last status. `JobEnded` if it did not finish."""
        while True:
            d = self.status(history=0)
            if d["state"] == "done":
                return d
            if d["state"] != "running":
                why = (d.get("outcome") or {}).get("failure") or d["state"]
                raise JobEnded(f"job {self.job_id} {d['state']} at step {d.get('step')}: {why}")
            time.sleep(POLL_S)

    def result(self) -> Any:
        """The trained module: a deep copy of the one submitted, with the weights the cluster
        trained (the daemon's `model.safetensors`, checked against its sha256)."""
        import safetensors.torch

        self.wait()
        buf = io.BytesIO()
        deadline = time.monotonic() + 60
        while True:  # the model is stored a moment after the job reads done
            try:
                self.client.download(f"/v1/jobs/{self.job_id}/outputs/model.safetensors", buf)
                break
            except ClientError:
                if time.monotonic() > deadline:
                    raise
                buf = io.BytesIO()
                time.sleep(POLL_S)
        state = safetensors.torch.load(buf.getvalue())
        trained = copy.deepcopy(self.model)
        trained.load_state_dict(state, strict=True)
        return trained

    def cancel(self) -> dict[str, Any]:
        return self.client.post(f"/v1/jobs/{self.job_id}/cancel")


def train(model: Any, *, steps: int, data: str | os.PathLike[str] | Mapping[str, Any] | None
          = None, seq_len: int = 64, batch_size: int = 8, micro_batches: int | None = None,
          lr: float = 3e-4, optimizer: str = "adamw", loss: str = "lm_cross_entropy",
          name: str = "notebook", seed: int = 0, stages: int | None = None,
          socket: str | None = None, timeout_s: float = 300.0,
          extra: Mapping[str, Mapping[str, Any]] | None = None) -> Run:
    """Capture `model` here and start training it on the cluster; returns at once (`Run`).

    `data`: a text file or directory (read here, byte-level), a `[data]` table as a dict, or
    None for the standard library's sources. `stages`: cut the model evenly over that many
    machines (default: the planner decides). `extra`: more job-file tables or keys (e.g.
    `{"compression": {"density": 0.1}}`; docs/jobs.md). `FusionError` (from the capture or the
    daemon) names what is wrong, as `fusionctl submit` would.
    """
    from fusiond.errors import LocalError
    from fusiond.graph import capture
    from fusiond.jobs.submit import check_data_fits, corpus_for_upload
    from fusiond.jobs.upload import encode_upload
    from fusiond.train.data import make_source
    from fusiond.train.model import loss_fn
    from fusiond.train.spec import parse_job

    if isinstance(data, Mapping):
        data_table: dict[str, Any] = dict(data)
    else:
        data_table = {"kind": "text", "seq_len": seq_len}
        if data is not None:
            data_table["path"] = str(Path(data).resolve())
    out = tempfile.mkdtemp(prefix=f"fusion-{name}-")  # the daemon's record names it; unused
    tables: dict[str, dict[str, Any]] = {
        "job": {"name": name, "steps": steps, "seed": seed, "output": out},
        "model": {"factory": FACTORY},
        "data": data_table,
        "loss": {"kind": loss},
        "optimizer": {"kind": optimizer, "lr": lr},
        "batch": {"size": batch_size, **({"micro_batches": micro_batches}
                                          if micro_batches is not None else {})},
    }
    for k, v in (extra or {}).items():
        tables.setdefault(k, {}).update(v)
    text = _toml(tables)
    cwd = Path.cwd()
    spec = parse_job(text, base=cwd, out_base=cwd)
    source = make_source(spec.data, spec.seed)
    batch = source.batch(0, max(2, spec.batch.micro_batch_size))
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's chatter
        captured = capture(model, [batch.inputs], targets=batch.targets, loss=loss_fn(spec.loss))
    check_data_fits(spec, model, source)
    from protocol import ir

    digest, corpus = corpus_for_upload(spec)
    meta: dict[str, Any] = {"toml": text, "base": str(cwd), "out_base": str(cwd),
                            "data_digest": digest, "data_default": bool(digest) and not corpus}
    if stages is not None:
        meta["stages"] = stages
    body = encode_upload(meta, ir.dumps(captured.graph), captured.state_bytes(), corpus)
    path = socket or os.environ.get("FUSION_API_SOCKET") or DEFAULT_SOCKET
    client = Client(Endpoint(socket_path=path), timeout=timeout_s)
    try:
        got = client.request("POST", "/v1/jobs", raw=body)
    except ClientError as e:
        raise LocalError(f"job refused: {e}") from None
    return Run(client, str(got["job_id"]), model, str(got.get("plan") or ""))
