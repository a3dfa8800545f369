"""IR round trip: serialise, load in a fresh process (no model code there), run: identical."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import safetensors.torch
import torch

from fusiond.graph import build_program, interleaved_assignment, partition
from protocol import ir
from tests.graph.models import case

CHILD = r"""
import sys, safetensors.torch, torch
from pathlib import Path
from fusiond.graph import build_program
from protocol import ir
d = Path(sys.argv[1])
torch.set_num_threads(int(sys.argv[2]))  # the parent's: a reduction's order follows the threads
graph = ir.loads((d / "graph.ir").read_bytes())
state = safetensors.torch.load((d / "state.safetensors").read_bytes())
batch = safetensors.torch.load((d / "batch.safetensors").read_bytes())
prog = build_program(graph, state)
for t in batch.values():
    if t.is_floating_point():
        t.requires_grad_(True)  # received activations are leaves (remote autodiff)
outs = prog(*[batch[n] for n in prog.input_names])
res = dict(zip(prog.output_names, outs))
res["loss"].backward()
res.update({"grad." + n: p.grad for n, p in prog.named_parameters()})
res.update({"grad_in." + n: t.grad for n, t in batch.items() if t.grad is not None})
flat = {k: v.detach().contiguous() for k, v in res.items()}
(d / "out.safetensors").write_bytes(safetensors.torch.save(flat))
"""


def _run_child(tmp: Path) -> dict[str, torch.Tensor]:
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", CHILD, str(tmp), str(torch.get_num_threads())],
                   cwd=root, check=True, timeout=240)
    return safetensors.torch.load((tmp / "out.safetensors").read_bytes())


def test_whole_graph_round_trip_in_fresh_process(tmp_path: Path) -> None:
    c = case("gpt2")
    g, state = c.captured.graph, c.captured.state
    (tmp_path / "graph.ir").write_bytes(ir.dumps(g))
    (tmp_path / "state.safetensors").write_bytes(safetensors.torch.save(state))
    batch = dict(zip(("input", "targets"), c.batch, strict=True))
    (tmp_path / "batch.safetensors").write_bytes(safetensors.torch.save(batch))
    got = _run_child(tmp_path)

    prog = build_program(g, state)
    (loss,) = prog(*c.batch)
    loss.backward()
    assert torch.equal(got["loss"], loss.detach())
    for n, p in prog.named_parameters():
        assert p.grad is not None
        assert torch.equal(got["grad." + n], p.grad), n


def test_partition_sub_graph_round_trip_in_fresh_process(tmp_path: Path) -> None:
    """A daemon receives only its partition's sub-graph; the last one holds the loss."""
    c = case("fanout")
    g, state = c.captured.graph, c.captured.state
    parts = partition(g, interleaved_assignment(g, 3, seed=7))
    # Run every partition here, feeding the last one from the others.
    values: dict[str, torch.Tensor] = dict(zip(("input", "targets"), c.batch, strict=True))
    for p in parts[:-1]:
        values.update(p.build(state).run({e.value: values[e.value] for e in p.inputs}))
    last = parts[-1]
    feed = {e.value: values[e.value].detach() for e in last.inputs}
    grads_in = {k: v.clone().requires_grad_(True) for k, v in feed.items() if v.is_floating_point()}
    sub_state = {n: state[n] for n in last.param_names}
    (tmp_path / "graph.ir").write_bytes(ir.dumps(last.graph))
    (tmp_path / "state.safetensors").write_bytes(safetensors.torch.save(sub_state))
    (tmp_path / "batch.safetensors").write_bytes(safetensors.torch.save(feed))
    got = _run_child(tmp_path)
    here = build_program(ir.loads(ir.dumps(last.graph)), sub_state)
    res = here.run({**feed, **grads_in})
    res["loss"].backward()
    assert torch.equal(got["loss"], res["loss"].detach())
    assert grads_in
    for k, v in grads_in.items():
        assert v.grad is not None and torch.equal(got["grad_in." + k], v.grad), k
    for n, p in here.named_parameters():
        assert p.grad is not None and torch.equal(got["grad." + n], p.grad), n
