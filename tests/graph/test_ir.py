"""protocol.ir: exact round trips, validation, and clear errors for bad input."""

from __future__ import annotations

import msgpack
import pytest
import xxhash

from protocol import ir
from protocol.errors import LimitExceeded, LocalProtocolError, RemoteProtocolError
from protocol.limits import Limits

R = ir.Ref
K = ir.RefKind


def small_graph() -> ir.Graph:
    """x (batch, 4) @ w.T + b, view to (batch*4//4, 4), with every literal kind."""
    f32 = "float32"
    return ir.Graph(
        inputs=(ir.InputSpec("input", ir.TensorMeta(("batch", 4), f32)),),
        outputs=(ir.OutputSpec("loss", R(K.NODE, "sum", 0)),),
        params=(
            ir.ParamSpec("lin.weight", ir.ParamKind.PARAMETER, ir.TensorMeta((3, 4), f32)),
            ir.ParamSpec("lin.bias", ir.ParamKind.PARAMETER, ir.TensorMeta((3,), f32)),
            ir.ParamSpec(
                "bn.count", ir.ParamKind.BUFFER, ir.TensorMeta((), "int64"), requires_grad=False
            ),
        ),
        nodes=(
            ir.Node(
                "size",
                "aten.sym_size.int",
                (R(K.INPUT, "input"), 0),
                {},
                (ir.TensorMeta((), "symint"),),
            ),
            ir.Node(
                "lin",
                "aten.linear.default",
                (R(K.INPUT, "input"), R(K.PARAM, "lin.weight"), R(K.PARAM, "lin.bias")),
                {},
                (ir.TensorMeta(("batch", 3), f32),),
                ("lin.weight", "lin.bias"),
                "lin",
            ),
            ir.Node(
                "full",
                "aten.full.default",
                ((R(K.NODE, "size"), 3), -float("inf")),
                {
                    "dtype": ir.DType("float32"),
                    "layout": ir.Layout("strided"),
                    "device": ir.Device("cpu"),
                    "pin_memory": False,
                },
                (ir.TensorMeta(("batch", 3), f32),),
            ),
            ir.Node(
                "split",
                "aten.split_with_sizes.default",
                (R(K.NODE, "lin"), (1, 2), 1),
                {},
                (ir.TensorMeta(("batch", 1), f32), ir.TensorMeta(("batch", 2), f32)),
            ),
            ir.Node(
                "clone",
                "aten.clone.default",
                (R(K.NODE, "split", 1),),
                {"memory_format": ir.MemoryFormat("contiguous_format")},
                (ir.TensorMeta(("batch", 2), f32),),
            ),
            ir.Node(
                "gelu",
                "aten.gelu.default",
                (R(K.NODE, "clone"),),
                {"approximate": "tanh"},
                (ir.TensorMeta(("batch", 2), f32),),
            ),
            ir.Node(
                "sum",
                "aten.sum.dim_IntList",
                (R(K.NODE, "gelu"), ()),
                {"dtype": None},
                (ir.TensorMeta((), f32),),
            ),
            ir.Node(
                "inc",
                "aten.add.Tensor",
                (R(K.BUFFER, "bn.count"), 1),
                {},
                (ir.TensorMeta((), "int64"),),
                ("bn.count",),
                "bn",
            ),
        ),
        symbols={"batch": 2},
        symbol_ranges={"batch": (1, None)},
        aliases={"tied.weight": "lin.weight"},
        buffer_updates={"bn.count": R(K.NODE, "inc")},
        meta={"model": "Tiny"},
    )


def test_round_trip_is_exact_and_deterministic() -> None:
    g = small_graph()
    data = ir.dumps(g)
    assert ir.dumps(g) == data
    back = ir.loads(data)
    assert back == g
    assert ir.dumps(back) == data
    assert back.nodes[2].args[1] == -float("inf")
    assert back.nodes[2].kwargs["dtype"] == ir.DType("float32")


def test_captured_graph_round_trips() -> None:
    from tests.graph.models import case

    g = case("fanout").captured.graph
    assert ir.loads(ir.dumps(g)) == g


def _envelope(g: ir.Graph) -> list[object]:
    env = msgpack.unpackb(ir.dumps(g), raw=False)
    assert isinstance(env, list)
    return env


def _repack(env: list[object]) -> bytes:
    return msgpack.packb(env, use_bin_type=True)  # type: ignore[no-any-return]


def test_wrong_version_is_refused_naming_both() -> None:
    env = _envelope(small_graph())
    env[1] = ir.IR_VERSION + 1
    with pytest.raises(RemoteProtocolError, match=rf"version {ir.IR_VERSION + 1}.*{ir.IR_VERSION}"):
        ir.loads(_repack(env))


def test_corruption_is_detected() -> None:
    data = bytearray(ir.dumps(small_graph()))
    data[len(data) // 2] ^= 0x40
    with pytest.raises(RemoteProtocolError):
        ir.loads(bytes(data))
    with pytest.raises(RemoteProtocolError):
        ir.loads(bytes(data[: len(data) // 3]))
    with pytest.raises(RemoteProtocolError, match="fusion-ir"):
        ir.loads(msgpack.packb({"hello": 1}))
    with pytest.raises(RemoteProtocolError):
        ir.loads(b"\xc1garbage")


def _with_body(mutate: object) -> bytes:
    env = _envelope(small_graph())
    body = msgpack.unpackb(env[2], raw=False)  # type: ignore[arg-type]
    mutate(body)  # type: ignore[operator]
    env[2] = msgpack.packb(body, use_bin_type=True)
    env[3] = xxhash.xxh64_digest(env[2])  # type: ignore[arg-type]
    return _repack(env)


def test_bad_fields_are_named() -> None:
    def bad_dtype(b: dict) -> None:  # type: ignore[type-arg]
        b["nodes"][1][4][0][1] = "float33"

    with pytest.raises(RemoteProtocolError, match=r"nodes\[1\].outputs\[0\].dtype"):
        ir.loads(_with_body(bad_dtype))

    def dangling(b: dict) -> None:  # type: ignore[type-arg]
        b["nodes"][4][2][0] = {"ref": ["node", "nope", 0]}

    with pytest.raises(RemoteProtocolError, match="nope"):
        ir.loads(_with_body(dangling))

    def bad_index(b: dict) -> None:  # type: ignore[type-arg]
        b["nodes"][4][2][0] = {"ref": ["node", "split", 2]}

    with pytest.raises(RemoteProtocolError, match="output 2"):
        ir.loads(_with_body(bad_index))

    def bad_type(b: dict) -> None:  # type: ignore[type-arg]
        b["symbols"]["batch"] = "two"

    with pytest.raises(RemoteProtocolError, match=r"symbols\.batch"):
        ir.loads(_with_body(bad_type))

    def evil_shape(b: dict) -> None:  # type: ignore[type-arg]
        b["nodes"][1][4][0][0][0] = "__import__('os').system('true')"

    with pytest.raises(RemoteProtocolError, match="unsupported syntax"):
        ir.loads(_with_body(evil_shape))

    def missing(b: dict) -> None:  # type: ignore[type-arg]
        del b["nodes"]

    with pytest.raises(RemoteProtocolError, match="nodes"):
        ir.loads(_with_body(missing))


def test_limits_apply() -> None:
    data = ir.dumps(small_graph())
    with pytest.raises(LimitExceeded):
        ir.loads(data, Limits(max_header_bytes=len(data) - 1))
    with pytest.raises(LimitExceeded):
        ir.loads(data, Limits(max_tensor_rank=1))


def test_symbolic_shapes_evaluate() -> None:
    s = {"batch": 3, "seq": 10}
    assert ir.eval_shape(("batch", "batch*seq", "((seq - 1)//2) + 1", 7), s) == (3, 30, 5, 7)
    assert ir.eval_dim("Max(1, seq - 12)", s) == 1
    assert ir.eval_dim("FloorDiv(seq, 3) + Mod(seq, 3)", s) == 4
    assert ir.TensorMeta(("batch", "seq", 4), "float32").nbytes(s) == 3 * 10 * 4 * 4
    assert ir.sym_names("Max(1, batch*seq)") == {"batch", "seq"}
    with pytest.raises(LocalProtocolError, match="no value"):
        ir.eval_dim("batch*heads", s)
    with pytest.raises(LocalProtocolError):
        ir.compile_sym("(lambda: 1)()")
    g = small_graph()
    assert g.shape_of(R(K.NODE, "lin")) == (2, 3)
    assert g.shape_of(R(K.NODE, "lin"), {"batch": 5}) == (5, 3)


def test_validate_catches_inconsistency() -> None:
    g = small_graph()
    bad = ir.Graph(g.inputs, g.outputs, g.params, (g.nodes[1], g.nodes[1]), g.symbols)
    with pytest.raises(RemoteProtocolError, match="duplicate node id"):
        ir.validate(bad)
    bad = ir.Graph(g.inputs, g.outputs, g.params, tuple(reversed(g.nodes)), g.symbols)
    with pytest.raises(RemoteProtocolError, match="not an earlier node"):
        ir.validate(bad)


def test_mutated_bodies_only_raise_protocol_errors() -> None:
    """Random edits of a valid body (checksum fixed up) never escape as other exceptions."""
    import contextlib
    import random

    from protocol.errors import ProtocolError

    rng = random.Random(7)
    env = _envelope(small_graph())
    body = bytes(env[2])  # type: ignore[arg-type]
    junk: list[object] = [None, -1, 2**40, 1.5, "x", "s0**99**99", [], {}, {"ref": 1}, [[1]], True]
    for _ in range(400):
        b = bytearray(body)
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            mutated = bytes(b)
        else:
            obj = msgpack.unpackb(body, raw=False)
            target = obj
            for _ in range(rng.randint(1, 4)):  # walk down to a random container
                if isinstance(target, dict) and target:
                    key = rng.choice(list(target))
                    if rng.random() < 0.3 or not isinstance(target[key], list | dict):
                        target[key] = rng.choice(junk)
                        break
                    target = target[key]
                elif isinstance(target, list) and target:
                    i = rng.randrange(len(target))
                    if rng.random() < 0.3 or not isinstance(target[i], list | dict):
                        target[i] = rng.choice(junk)
                        break
                    target = target[i]
            mutated = msgpack.packb(obj, use_bin_type=True)
        env2 = [env[0], env[1], mutated, xxhash.xxh64_digest(mutated)]
        with contextlib.suppress(ProtocolError):
            ir.loads(_repack(env2))
