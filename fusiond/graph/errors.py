"""Errors of the OP-DAG: capture, registry, partition and execution."""

from __future__ import annotations

from fusiond.errors import LocalError


class GraphError(LocalError):
    """Root of fusiond.graph errors."""


class CaptureError(GraphError):
    """torch.export could not export the model; the message names the construct and module."""


class UnsupportedOpError(CaptureError):
    """An op the registry cannot run; the message names the op and the module path."""

    def __init__(self, op: str, module_path: str = "", node: str = "",
                 reason: str = "is not in the fusion op registry") -> None:
        where = f" in module {module_path!r}" if module_path else ""
        at = f" (node {node!r})" if node else ""
        super().__init__(f"op {op!r}{where}{at} {reason}")
        self.op = op
        self.module_path = module_path


class PartitionError(GraphError):
    """An assignment that cannot be partitioned (missing nodes, a cycle between partitions)."""


class ExecutionError(GraphError):
    """A partition was run with missing or mismatched inputs or gradients."""
