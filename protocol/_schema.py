"""Declarative msgpack schemas: validate frozen dataclasses from their type annotations.

A `Struct` subclass is a frozen dataclass whose field annotations say what the wire may hold.
Supported annotations (anything else is a TypeError when the schema is first compiled):

    int, float, bool, str, bytes          msgpack int / float (int accepted) / bool / str / bin
    T | None                              nil or T
    tuple[T, ...]                         array of T (decoded as a tuple)
    tuple[A, B, ...fixed]                 array of exactly those items
    dict[str, V]                          map with str keys
    an enum.Enum subclass                 its `.value` (str or int)
    a Struct subclass                     a map of that struct's fields (nested validation)
    typing.Any                            any msgpack value (nil/bool/int/float/str/bin/array/map
                                          with str keys), nested at most MAX_ANY_DEPTH deep

A struct is encoded as a map {field name: value}. Decoding ignores unknown keys (forward
compatibility), fills fields that have defaults, and raises RemoteProtocolError naming the
struct and the field path for a missing or mistyped field. Encoding validates the same way and
raises LocalProtocolError. Sizes of strings, bins, arrays and maps are bounded by `Limits`
inside the msgpack unpacker, before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, ClassVar, Final

import msgpack

from protocol.errors import (
    LimitExceeded,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from protocol.limits import DEFAULT_LIMITS, Limits

MAX_ANY_DEPTH: Final = 32
"""How deeply a `typing.Any` field may nest arrays and maps."""
_INT_MIN: Final = -(1 << 63)
_INT_MAX: Final = (1 << 64) - 1

WIRE: Final = "wire"
"""Field metadata key; `field(metadata={WIRE: False})` keeps a field off the wire."""


class _Err:
    """Builds the right error class for the direction (decode = remote, encode = local)."""

    def __init__(self, remote: bool) -> None:
        self.cls: type[ProtocolError] = RemoteProtocolError if remote else LocalProtocolError

    def __call__(self, path: str, what: str) -> ProtocolError:
        return self.cls(f"{path}: {what}")


_REMOTE: Final = _Err(True)
_LOCAL: Final = _Err(False)


def _tname(value: object) -> str:
    return type(value).__name__


class _Conv:
    """Converts one annotated type between Python values and msgpack-ready values.

    `depth` counts nesting inside a `typing.Any` value only (schema-typed nesting is finite),
    so that decoding and encoding apply the same MAX_ANY_DEPTH.
    """

    label = "?"

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        raise NotImplementedError

    def enc(self, v: Any, path: str, err: _Err, limits: Limits) -> Any:
        # Encoding validates with the same rules as decoding; both directions share `dec`
        # for scalars, containers override.
        return self.dec(v, path, err, 0)


class _Int(_Conv):
    label = "int"

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        if isinstance(v, bool) or not isinstance(v, int):
            raise err(path, f"expected int, got {_tname(v)}")
        if not _INT_MIN <= v <= _INT_MAX:
            raise err(path, f"int {v} does not fit in 64 bits")
        return int(v)


class _Float(_Conv):
    label = "float"

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise err(path, f"expected float, got {_tname(v)}")
        if isinstance(v, int) and not _INT_MIN <= v <= _INT_MAX:
            raise err(path, f"int {v} does not fit in 64 bits")
        return float(v)


class _Bool(_Conv):
    label = "bool"

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        if not isinstance(v, bool):
            raise err(path, f"expected bool, got {_tname(v)}")
        return v


class _Str(_Conv):
    label = "str"

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        if not isinstance(v, str):
            raise err(path, f"expected str, got {_tname(v)}")
        return v

    def enc(self, v: Any, path: str, err: _Err, limits: Limits) -> Any:
        self.dec(v, path, err, 0)
        # A character is at most 4 UTF-8 bytes: only measure when the limit could be hit.
        if len(v) * 4 > limits.max_string_bytes:
            try:
                n = len(v.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise err(path, f"str is not encodable as UTF-8: {exc}") from None
            if n > limits.max_string_bytes:
                raise err(path, f"str is {n} bytes, limit is {limits.max_string_bytes}")
        return v


class _Bytes(_Conv):
    label = "bytes"

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        if not isinstance(v, bytes | bytearray | memoryview):
            raise err(path, f"expected bytes, got {_tname(v)}")
        return bytes(v)

    def enc(self, v: Any, path: str, err: _Err, limits: Limits) -> Any:
        b = self.dec(v, path, err, 0)
        if len(b) > limits.max_header_bytes:
            raise err(path, f"bytes is {len(b)} long, limit is {limits.max_header_bytes}")
        return b


class _Optional(_Conv):
    def __init__(self, inner: _Conv) -> None:
        self.inner = inner
        self.label = f"{inner.label} | None"

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        return None if v is None else self.inner.dec(v, path, err, depth)

    def enc(self, v: Any, path: str, err: _Err, limits: Limits) -> Any:
        return None if v is None else self.inner.enc(v, path, err, limits)


def _check_len(n: int, path: str, err: _Err, limits: Limits) -> None:
    if n > limits.max_list_items:
        raise err(path, f"{n} items, limit is {limits.max_list_items}")


class _Tuple(_Conv):
    def __init__(self, item: _Conv) -> None:
        self.item = item
        self.label = f"tuple[{item.label}, ...]"

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        if not isinstance(v, list | tuple):
            raise err(path, f"expected array, got {_tname(v)}")
        dec = self.item.dec
        return tuple(dec(x, f"{path}[{i}]", err, depth) for i, x in enumerate(v))

    def enc(self, v: Any, path: str, err: _Err, limits: Limits) -> Any:
        if not isinstance(v, list | tuple):
            raise err(path, f"expected tuple, got {_tname(v)}")
        _check_len(len(v), path, err, limits)
        enc = self.item.enc
        return [enc(x, f"{path}[{i}]", err, limits) for i, x in enumerate(v)]


class _FixedTuple(_Conv):
    def __init__(self, items: tuple[_Conv, ...]) -> None:
        self.items = items
        self.label = "tuple[" + ", ".join(i.label for i in items) + "]"

    def _arity(self, v: Any, path: str, err: _Err) -> None:
        if not isinstance(v, list | tuple):
            raise err(path, f"expected array, got {_tname(v)}")
        if len(v) != len(self.items):
            raise err(path, f"expected {len(self.items)} items, got {len(v)}")

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        self._arity(v, path, err)
        return tuple(
            c.dec(x, f"{path}[{i}]", err, depth) for i, (c, x) in enumerate(zip(self.items, v))
        )

    def enc(self, v: Any, path: str, err: _Err, limits: Limits) -> Any:
        self._arity(v, path, err)
        return [
            c.enc(x, f"{path}[{i}]", err, limits) for i, (c, x) in enumerate(zip(self.items, v))
        ]


class _Dict(_Conv):
    def __init__(self, value: _Conv) -> None:
        self.value = value
        self.label = f"dict[str, {value.label}]"

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        if not isinstance(v, dict):
            raise err(path, f"expected map, got {_tname(v)}")
        out: dict[str, Any] = {}
        dec = self.value.dec
        for k, x in v.items():
            if not isinstance(k, str):
                raise err(path, f"map key {k!r} is not a str")
            out[k] = dec(x, f"{path}[{k!r}]", err, depth)
        return out

    def enc(self, v: Any, path: str, err: _Err, limits: Limits) -> Any:
        if not isinstance(v, dict):
            raise err(path, f"expected dict, got {_tname(v)}")
        _check_len(len(v), path, err, limits)
        out: dict[str, Any] = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise err(path, f"dict key {k!r} is not a str")
            _STR.enc(k, f"{path} key", err, limits)
            out[k] = self.value.enc(x, f"{path}[{k!r}]", err, limits)
        return out


class _Enum(_Conv):
    def __init__(self, cls: type[enum.Enum]) -> None:
        self.cls = cls
        self.label = cls.__name__
        self.by_value = {m.value: m for m in cls}

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        if isinstance(v, bool) or not isinstance(v, str | int):
            raise err(path, f"expected {self.label} value, got {_tname(v)}")
        try:
            return self.by_value[v]
        except KeyError:
            raise err(
                path, f"{v!r} is not a {self.label} (one of {sorted(map(str, self.by_value))})"
            ) from None

    def enc(self, v: Any, path: str, err: _Err, limits: Limits) -> Any:
        if isinstance(v, self.cls):
            return v.value
        return self.dec(v, path, err, 0).value


class _Any(_Conv):
    label = "any"

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        if depth > MAX_ANY_DEPTH:
            raise err(path, f"nested deeper than {MAX_ANY_DEPTH} levels")
        if v is None or isinstance(v, bool | int | float | str):
            if isinstance(v, int) and not _INT_MIN <= v <= _INT_MAX:
                raise err(path, f"int {v} does not fit in 64 bits")
            return v
        if isinstance(v, bytes | bytearray | memoryview):
            return bytes(v)
        if isinstance(v, list | tuple):
            return [self.dec(x, f"{path}[{i}]", err, depth + 1) for i, x in enumerate(v)]
        if isinstance(v, dict):
            out: dict[str, Any] = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    raise err(path, f"map key {k!r} is not a str")
                out[k] = self.dec(x, f"{path}[{k!r}]", err, depth + 1)
            return out
        raise err(path, f"{_tname(v)} is not a msgpack value")

    def enc(self, v: Any, path: str, err: _Err, limits: Limits) -> Any:
        out = self.dec(v, path, err, 0)
        _check_sizes(out, path, err, limits)
        return out


def _check_sizes(v: Any, path: str, err: _Err, limits: Limits) -> None:
    """Local check of an Any value's string and container sizes (decoding has msgpack's)."""
    if isinstance(v, str):
        _STR.enc(v, path, err, limits)
    elif isinstance(v, bytes) and len(v) > limits.max_header_bytes:
        raise err(path, f"bytes is {len(v)} long, limit is {limits.max_header_bytes}")
    elif isinstance(v, list):
        _check_len(len(v), path, err, limits)
        for x in v:
            _check_sizes(x, path, err, limits)
    elif isinstance(v, dict):
        _check_len(len(v), path, err, limits)
        for k, x in v.items():
            _STR.enc(k, path, err, limits)
            _check_sizes(x, path, err, limits)


class _StructRef(_Conv):
    """A nested Struct; resolved lazily so that structs may refer to each other."""

    def __init__(self, cls: type[Struct]) -> None:
        self.cls = cls
        self.label = cls.__name__

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        return _schema(self.cls).dec(v, path, err, depth)

    def enc(self, v: Any, path: str, err: _Err, limits: Limits) -> Any:
        if not isinstance(v, self.cls):
            raise err(path, f"expected {self.label}, got {_tname(v)}")
        return _schema(self.cls).enc(v, path, err, limits)


_STR: Final = _Str()
_SCALARS: Final[dict[object, _Conv]] = {
    int: _Int(),
    float: _Float(),
    bool: _Bool(),
    str: _STR,
    bytes: _Bytes(),
    Any: _Any(),
}


def _compile(tp: Any, where: str) -> _Conv:
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return _Optional(_compile(rest[0], where))
        raise TypeError(f"{where}: only `T | None` unions are supported, not {tp}")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _Tuple(_compile(args[0], where))
        if args:
            return _FixedTuple(tuple(_compile(a, where) for a in args))
    if origin is dict and len(args) == 2 and args[0] is str:
        return _Dict(_compile(args[1], where))
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return _Enum(tp)
        if issubclass(tp, Struct):
            return _StructRef(tp)
    raise TypeError(f"{where}: annotation {tp!r} has no wire mapping")


@dataclasses.dataclass(frozen=True, slots=True)
class _FieldSpec:
    name: str
    conv: _Conv
    required: bool


class _StructSchema:
    """The compiled schema of one Struct subclass."""

    def __init__(self, cls: type[Struct]) -> None:
        self.cls = cls
        self.name = cls.__name__
        hints = typing.get_type_hints(cls)
        specs: list[_FieldSpec] = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if not f.metadata.get(WIRE, True):
                continue
            conv = _compile(hints[f.name], f"{self.name}.{f.name}")
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            specs.append(_FieldSpec(f.name, conv, required))
        self.fields = tuple(specs)

    def kwargs(self, v: Any, path: str, err: _Err, depth: int) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise err(path, f"expected a map of {self.name} fields, got {_tname(v)}")
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.name in v:
                out[f.name] = f.conv.dec(v[f.name], f"{path}.{f.name}", err, depth)
            elif f.required:
                raise err(path, f"missing field {f.name!r} ({f.conv.label})")
        return out

    def dec(self, v: Any, path: str, err: _Err, depth: int) -> Any:
        try:
            return self.cls(**self.kwargs(v, path, err, depth))
        except ProtocolError:
            raise
        except (TypeError, ValueError) as exc:  # a __post_init__ check of the struct itself
            raise err(path, f"invalid {self.name}: {exc}") from None

    def enc(self, obj: Any, path: str, err: _Err, limits: Limits) -> dict[str, Any]:
        return {
            f.name: f.conv.enc(getattr(obj, f.name), f"{path}.{f.name}", err, limits)
            for f in self.fields
        }


_SCHEMAS: dict[type[Struct], _StructSchema] = {}


def _schema(cls: type[Struct]) -> _StructSchema:
    s = _SCHEMAS.get(cls)
    if s is None:
        s = _SCHEMAS[cls] = _StructSchema(cls)
    return s


class Struct:
    """Base of every wire record: subclass it as `@dataclass(frozen=True)` with annotations.

    See the module docstring for the supported annotations and the validation contract.
    """

    __wire_name__: ClassVar[str] = ""

    def to_wire(self, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
        """This struct as a msgpack-ready map; LocalProtocolError naming a bad field."""
        return _schema(type(self)).enc(self, type(self).__name__, _LOCAL, limits)

    @classmethod
    def from_wire(cls, value: Any, **extra: Any) -> Any:
        """Validate a decoded msgpack map into `cls`; RemoteProtocolError naming a bad field.

        `extra` are keyword arguments for fields kept off the wire (e.g. a message payload).
        """
        schema = _schema(cls)
        kwargs = schema.kwargs(value, cls.__name__, _REMOTE, 0)
        try:
            return cls(**kwargs, **extra)
        except ProtocolError:
            raise
        except (TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"{cls.__name__}: invalid: {exc}") from None

    @classmethod
    def wire_fields(cls) -> list[tuple[str, str, bool]]:
        """(name, type label, required) of each wire field, for docs and tests."""
        return [(f.name, f.conv.label, f.required) for f in _schema(cls).fields]


def packb(value: Any) -> bytes:
    """msgpack-encode a validated value (str as UTF-8 str, bytes as bin, floats as float64)."""
    try:
        return msgpack.packb(value, use_bin_type=True, strict_types=False)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot msgpack-encode: {exc}") from None


def unpackb(data: bytes | memoryview, what: str, limits: Limits = DEFAULT_LIMITS) -> Any:
    """msgpack-decode one object, every declared size bounded by `limits` before allocation.

    Raises RemoteProtocolError for malformed msgpack, trailing bytes, ext types or limits.
    """
    n = len(data)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            # A declared size can never exceed the bytes that hold it; bounding by both the
            # limit and the data length keeps a 5-byte "map of 2^32 entries" from allocating.
            max_str_len=min(limits.max_string_bytes, n),
            max_bin_len=min(limits.max_header_bytes, n),
            max_array_len=min(limits.max_list_items, n),
            max_map_len=min(limits.max_list_items, n // 2),
            max_ext_len=0,
            ext_hook=_no_ext,
        )
    except RemoteProtocolError:
        raise
    except Exception as exc:
        if isinstance(exc, ValueError) and " exceeds max_" in str(exc):
            raise LimitExceeded(f"{what}: declared size {exc}") from None
        # msgpack's C and pure-Python unpackers raise a spread of types (ValueError,
        # ExtraData, FormatError, StackError, OutOfData, UnicodeDecodeError, ...) that varies
        # across versions; all of them mean the peer's bytes are not valid msgpack.
        raise RemoteProtocolError(
            f"{what}: malformed msgpack: {type(exc).__name__}: {exc}"
        ) from None


def _no_ext(code: int, data: bytes) -> Any:
    raise RemoteProtocolError(f"msgpack ext type {code} is not allowed")
