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
from typing import Any, Final

import msgpack

from protocol.errors import LimitExceeded, LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits

MAX_ANY_DEPTH: Final = 32
"""How deeply a `typing.Any` field may nest arrays and maps."""
_INT_MIN: Final = -(1 << 63)
_INT_MAX: Final = (1 << 64) - 1

WIRE: Final = "wire"
"""Field metadata key; `field(metadata={WIRE: False})` keeps a field off the wire."""


class _Fail(Exception):
    """A validation failure deep inside a value; containers prepend their path segment as it
    propagates, so the success path never formats a path (zero-cost `try` in 3.11+)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.parts: list[str] = []

    def message(self, root: str) -> str:
        return f"{root}{''.join(reversed(self.parts))}: {self.what}"


def _tname(value: object) -> str:
    return type(value).__name__


class _Conv:
    """Converts one annotated type between msgpack-decoded values and Python values.

    `dec` validates a decoded value (raising _Fail); `enc` validates a Python value and
    returns what msgpack should pack (raising _Fail). `depth` counts nesting inside a
    `typing.Any` value only (schema-typed nesting is finite), so both directions apply the
    same MAX_ANY_DEPTH.
    """

    label = "?"

    def dec(self, v: Any, depth: int) -> Any:
        raise NotImplementedError

    def enc(self, v: Any, limits: Limits) -> Any:
        # Scalars validate the same way in both directions.
        return self.dec(v, 0)


class _Int(_Conv):
    label = "int"

    def dec(self, v: Any, depth: int) -> Any:
        if type(v) is not int and (isinstance(v, bool) or not isinstance(v, int)):
            raise _Fail(f"expected int, got {_tname(v)}")
        if not _INT_MIN <= v <= _INT_MAX:
            raise _Fail(f"int {v} does not fit in 64 bits")
        return int(v)


class _Float(_Conv):
    label = "float"

    def dec(self, v: Any, depth: int) -> Any:
        if type(v) is float:
            return v
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise _Fail(f"expected float, got {_tname(v)}")
        if isinstance(v, int) and not _INT_MIN <= v <= _INT_MAX:
            raise _Fail(f"int {v} does not fit in 64 bits")
        return float(v)


class _Bool(_Conv):
    label = "bool"

    def dec(self, v: Any, depth: int) -> Any:
        if not isinstance(v, bool):
            raise _Fail(f"expected bool, got {_tname(v)}")
        return v


class _Str(_Conv):
    label = "str"

    def dec(self, v: Any, depth: int) -> Any:
        if not isinstance(v, str):
            raise _Fail(f"expected str, got {_tname(v)}")
        return v

    def enc(self, v: Any, limits: Limits) -> Any:
        if not isinstance(v, str):
            raise _Fail(f"expected str, got {_tname(v)}")
        # A character is at most 4 UTF-8 bytes: only measure when the limit could be hit.
        if len(v) * 4 > limits.max_string_bytes:
            try:
                n = len(v.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise _Fail(f"str is not encodable as UTF-8: {exc}") from None
            if n > limits.max_string_bytes:
                raise _Fail(f"str is {n} bytes, limit is {limits.max_string_bytes}")
        return v


class _Bytes(_Conv):
    label = "bytes"

    def dec(self, v: Any, depth: int) -> Any:
        if type(v) is bytes:
            return v
        if not isinstance(v, bytes | bytearray | memoryview):
            raise _Fail(f"expected bytes, got {_tname(v)}")
        return bytes(v)

    def enc(self, v: Any, limits: Limits) -> Any:
        b = self.dec(v, 0)
        if len(b) > limits.max_header_bytes:
            raise _Fail(f"bytes is {len(b)} long, limit is {limits.max_header_bytes}")
        return b


class _Optional(_Conv):
    def __init__(self, inner: _Conv) -> None:
        self.inner = inner
        self.label = f"{inner.label} | None"

    def dec(self, v: Any, depth: int) -> Any:
        return None if v is None else self.inner.dec(v, depth)

    def enc(self, v: Any, limits: Limits) -> Any:
        return None if v is None else self.inner.enc(v, limits)


def _check_len(n: int, limits: Limits) -> None:
    if n > limits.max_list_items:
        raise _Fail(f"{n} items, limit is {limits.max_list_items}")


class _Tuple(_Conv):
    def __init__(self, item: _Conv) -> None:
        self.item = item
        self.label = f"tuple[{item.label}, ...]"

    def dec(self, v: Any, depth: int) -> Any:
        if not isinstance(v, list | tuple):
            raise _Fail(f"expected array, got {_tname(v)}")
        dec = self.item.dec
        out = []
        for x in v:
            try:
                out.append(dec(x, depth))
            except _Fail as e:
                e.parts.append(f"[{len(out)}]")
                raise
        return tuple(out)

    def enc(self, v: Any, limits: Limits) -> Any:
        if not isinstance(v, list | tuple):
            raise _Fail(f"expected tuple, got {_tname(v)}")
        _check_len(len(v), limits)
        enc = self.item.enc
        out = []
        for x in v:
            try:
                out.append(enc(x, limits))
            except _Fail as e:
                e.parts.append(f"[{len(out)}]")
                raise
        return out


class _FixedTuple(_Conv):
    def __init__(self, items: tuple[_Conv, ...]) -> None:
        self.items = items
        self.label = "tuple[" + ", ".join(i.label for i in items) + "]"

    def _arity(self, v: Any) -> None:
        if not isinstance(v, list | tuple):
            raise _Fail(f"expected array, got {_tname(v)}")
        if len(v) != len(self.items):
            raise _Fail(f"expected {len(self.items)} items, got {len(v)}")

    def dec(self, v: Any, depth: int) -> Any:
        self._arity(v)
        out = []
        for c, x in zip(self.items, v):
            try:
                out.append(c.dec(x, depth))
            except _Fail as e:
                e.parts.append(f"[{len(out)}]")
                raise
        return tuple(out)

    def enc(self, v: Any, limits: Limits) -> Any:
        self._arity(v)
        out = []
        for c, x in zip(self.items, v):
            try:
                out.append(c.enc(x, limits))
            except _Fail as e:
                e.parts.append(f"[{len(out)}]")
                raise
        return out


class _Dict(_Conv):
    def __init__(self, value: _Conv) -> None:
        self.value = value
        self.label = f"dict[str, {value.label}]"

    def dec(self, v: Any, depth: int) -> Any:
        if not isinstance(v, dict):
            raise _Fail(f"expected map, got {_tname(v)}")
        out: dict[str, Any] = {}
        dec = self.value.dec
        for k, x in v.items():
            if not isinstance(k, str):
                raise _Fail(f"map key {k!r} is not a str")
            try:
                out[k] = dec(x, depth)
            except _Fail as e:
                e.parts.append(f"[{k!r}]")
                raise
        return out

    def enc(self, v: Any, limits: Limits) -> Any:
        if not isinstance(v, dict):
            raise _Fail(f"expected dict, got {_tname(v)}")
        _check_len(len(v), limits)
        out: dict[str, Any] = {}
        enc = self.value.enc
        for k, x in v.items():
            if not isinstance(k, str):
                raise _Fail(f"dict key {k!r} is not a str")
            try:
                _STR.enc(k, limits)
                out[k] = enc(x, limits)
            except _Fail as e:
                e.parts.append(f"[{k!r}]")
                raise
        return out


class _Enum(_Conv):
    def __init__(self, cls: type[enum.Enum]) -> None:
        self.cls = cls
        self.label = cls.__name__
        self.by_value = {m.value: m for m in cls}

    def dec(self, v: Any, depth: int) -> Any:
        if isinstance(v, bool) or not isinstance(v, str | int):
            raise _Fail(f"expected {self.label} value, got {_tname(v)}")
        try:
            return self.by_value[v]
        except KeyError:
            raise _Fail(
                f"{v!r} is not a {self.label} (one of {sorted(map(str, self.by_value))})"
            ) from None

    def enc(self, v: Any, limits: Limits) -> Any:
        if isinstance(v, self.cls):
            return v.value
        return self.dec(v, 0).value


class _Any(_Conv):
    label = "any"

    def dec(self, v: Any, depth: int) -> Any:
        if depth > MAX_ANY_DEPTH:
            raise _Fail(f"nested deeper than {MAX_ANY_DEPTH} levels")
        if v is None or isinstance(v, bool | float | str):
            return v
        if isinstance(v, int):
            if not _INT_MIN <= v <= _INT_MAX:
                raise _Fail(f"int {v} does not fit in 64 bits")
            return v
        if isinstance(v, bytes | bytearray | memoryview):
            return bytes(v)
        if isinstance(v, list | tuple):
            out = []
            for x in v:
                try:
                    out.append(self.dec(x, depth + 1))
                except _Fail as e:
                    e.parts.append(f"[{len(out)}]")
                    raise
            return out
        if isinstance(v, dict):
            res: dict[str, Any] = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    raise _Fail(f"map key {k!r} is not a str")
                try:
                    res[k] = self.dec(x, depth + 1)
                except _Fail as e:
                    e.parts.append(f"[{k!r}]")
                    raise
            return res
        raise _Fail(f"{_tname(v)} is not a msgpack value")

    def enc(self, v: Any, limits: Limits) -> Any:
        out = self.dec(v, 0)
        _check_sizes(out, limits)
        return out


def _check_sizes(v: Any, limits: Limits) -> None:
    """Local check of an Any value's string and container sizes (decoding has msgpack's)."""
    if isinstance(v, str):
        _STR.enc(v, limits)
    elif isinstance(v, bytes) and len(v) > limits.max_header_bytes:
        raise _Fail(f"bytes is {len(v)} long, limit is {limits.max_header_bytes}")
    elif isinstance(v, list):
        _check_len(len(v), limits)
        for x in v:
            _check_sizes(x, limits)
    elif isinstance(v, dict):
        _check_len(len(v), limits)
        for k, x in v.items():
            _STR.enc(k, limits)
            _check_sizes(x, limits)


class _StructRef(_Conv):
    """A nested Struct; resolved lazily so that structs may refer to each other."""

    def __init__(self, cls: type[Struct]) -> None:
        self.cls = cls
        self.label = cls.__name__

    def dec(self, v: Any, depth: int) -> Any:
        return _schema(self.cls).dec(v, depth)

    def enc(self, v: Any, limits: Limits) -> Any:
        if not isinstance(v, self.cls):
            raise _Fail(f"expected {self.label}, got {_tname(v)}")
        return _schema(self.cls).enc(v, limits)


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
    segment: str
    """".name", the path segment an error inside this field gets."""


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
            specs.append(_FieldSpec(f.name, conv, required, "." + f.name))
        self.fields = tuple(specs)

    def kwargs(self, v: Any, depth: int) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise _Fail(f"expected a map of {self.name} fields, got {_tname(v)}")
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.name in v:
                try:
                    out[f.name] = f.conv.dec(v[f.name], depth)
                except _Fail as e:
                    e.parts.append(f.segment)
                    raise
            elif f.required:
                raise _Fail(f"missing field {f.name!r} ({f.conv.label})")
        return out

    def dec(self, v: Any, depth: int) -> Any:
        kwargs = self.kwargs(v, depth)
        try:
            return self.cls(**kwargs)
        except (TypeError, ValueError) as exc:  # a __post_init__ check of the struct itself
            raise _Fail(f"invalid {self.name}: {exc}") from None

    def enc(self, obj: Any, limits: Limits) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in self.fields:
            try:
                out[f.name] = f.conv.enc(getattr(obj, f.name), limits)
            except _Fail as e:
                e.parts.append(f.segment)
                raise
        return out


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

    def to_wire(self, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
        """This struct as a msgpack-ready map; LocalProtocolError naming a bad field."""
        try:
            return _schema(type(self)).enc(self, limits)
        except _Fail as e:
            raise LocalProtocolError(e.message(type(self).__name__)) from None

    @classmethod
    def from_wire(cls, value: Any, **extra: Any) -> Any:
        """Validate a decoded msgpack map into `cls`; RemoteProtocolError naming a bad field.

        `extra` are keyword arguments for fields kept off the wire (e.g. a message payload).
        """
        try:
            kwargs = _schema(cls).kwargs(value, 0)
        except _Fail as e:
            raise RemoteProtocolError(e.message(cls.__name__)) from None
        try:
            return cls(**kwargs, **extra)
        except ProtocolError:
            raise
        except (TypeError, ValueError) as exc:  # a __post_init__ check of the struct itself
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
