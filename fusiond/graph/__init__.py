"""fusiond.graph: the OP-DAG. Capture a model (torch.export) into `protocol.ir`, run IR ops
through the registry, cut the graph into partitions and run them with remote-autodiff semantics.
"""

from fusiond.graph.capture import (
    CapturedModel,
    capture,
    state_from_bytes,
    state_to_bytes,
    state_to_parts,
    state_views,
)
from fusiond.graph.driver import Driver, StageRunner
from fusiond.graph.errors import (
    CaptureError,
    ExecutionError,
    GraphError,
    PartitionError,
    UnsupportedOpError,
)
from fusiond.graph.partition import (
    SINK,
    SOURCE,
    Edge,
    Partition,
    contiguous_assignment,
    interleaved_assignment,
    partition,
)
from fusiond.graph.program import GraphProgram, build_program, mutated_buffers

__all__ = [
    "SINK",
    "SOURCE",
    "CaptureError",
    "CapturedModel",
    "Driver",
    "Edge",
    "ExecutionError",
    "GraphError",
    "GraphProgram",
    "Partition",
    "PartitionError",
    "StageRunner",
    "UnsupportedOpError",
    "build_program",
    "capture",
    "contiguous_assignment",
    "interleaved_assignment",
    "mutated_buffers",
    "partition",
    "state_from_bytes",
    "state_to_bytes",
    "state_to_parts",
    "state_views",
]
