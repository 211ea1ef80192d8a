"""Hypothesis strategies for any protobuf message, from its descriptor: every
field may be set, to a value of its type drawn from the edges (0, -1, the
type's limits) or anywhere, strings and bytes short or odd, nested messages
recursively (bounded depth), repeated and map fields a few items long; and
messages made only of fields the receiver does not declare (`unknown_fields`)."""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

_F = FieldDescriptor
_INT_RANGES = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1), _F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), _F.TYPE_UINT32: (0, 2**32 - 1),
    _F.TYPE_FIXED32: (0, 2**32 - 1), _F.TYPE_INT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SINT64: (-(2**63), 2**63 - 1), _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1), _F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.type in _INT_RANGES:
        low, high = _INT_RANGES[field.type]
        return st.integers(max(low, -3), min(high, 40)) | st.sampled_from(
            [low, high, low + 1, high - 1]) | st.integers(low, high)
    if field.type in (_F.TYPE_FLOAT, _F.TYPE_DOUBLE):
        return st.floats(width=32 if field.type == _F.TYPE_FLOAT else 64)
    if field.type == _F.TYPE_BOOL:
        return st.booleans()
    if field.type == _F.TYPE_STRING:
        return st.text(max_size=24)
    if field.type == _F.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == _F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [99, -1])
    raise ValueError(f"no strategy for field {field.full_name} of type {field.type}")


def _dicts(descriptor: Descriptor, depth: int) -> st.SearchStrategy:
    optional = {}
    for field in descriptor.fields:
        if field.type == _F.TYPE_MESSAGE:
            if depth <= 0:
                continue
            value = _dicts(field.message_type, depth - 1)
        else:
            value = _scalar(field)
        repeated = field.is_repeated
        optional[field.name] = st.lists(value, max_size=5) if repeated else value
    return st.fixed_dictionaries({}, optional=optional)


def _is_map(field: FieldDescriptor) -> bool:
    return (field.type == _F.TYPE_MESSAGE and field.is_repeated
            and field.message_type.GetOptions().map_entry)


def _fill(message: Message, values: dict) -> Message:
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        if _is_map(field):  # drawn as a list of {key, value} entries
            target = getattr(message, name)
            for entry in value:
                if "key" in entry and "value" in entry:  # scalar values only (ours)
                    target[entry["key"]] = entry["value"]
        elif field.type == _F.TYPE_MESSAGE:
            if field.is_repeated:
                for item in value:
                    _fill(getattr(message, name).add(), item)
            else:
                _fill(getattr(message, name), value)
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)  # the last member of a oneof wins
    return message


def messages(message_class: type[Message], depth: int = 3) -> st.SearchStrategy[Message]:
    """Random instances of `message_class`."""
    return _dicts(message_class.DESCRIPTOR, depth).map(lambda v: _fill(message_class(), v))


# ------------------------------------------------------------------ raw wire format

_MAX_FIELD_NUMBER = 2**29 - 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _wire_field(numbers: st.SearchStrategy[int], depth: int) -> st.SearchStrategy[bytes]:
    """One field, well formed, of any wire type: varint (0), 64-bit (1),
    length-delimited (2), a group (3 ... 4, holding more fields) or 32-bit (5)."""
    kinds = [
        st.tuples(numbers, st.integers(0, 2**64 - 1)).map(lambda f: _tag(f[0], 0) + _varint(f[1])),
        st.tuples(numbers, st.binary(min_size=8, max_size=8)).map(lambda f: _tag(f[0], 1) + f[1]),
        st.tuples(numbers, st.binary(max_size=64)).map(
            lambda f: _tag(f[0], 2) + _varint(len(f[1])) + f[1]),
        st.tuples(numbers, st.binary(min_size=4, max_size=4)).map(lambda f: _tag(f[0], 5) + f[1]),
    ]
    if depth > 0:
        kinds.append(st.tuples(numbers, st.lists(_wire_field(numbers, depth - 1), max_size=3))
                     .map(lambda f: _tag(f[0], 3) + b"".join(f[1]) + _tag(f[0], 4)))
    return st.one_of(kinds)


def unknown_fields(message_class: type[Message], depth: int = 2) -> st.SearchStrategy[bytes]:
    """Serialized `message_class` made only of fields it does not declare (any
    number up to 2**29 - 1, any wire type, groups nested `depth` deep): a
    newer peer's message as this version parses it. proto3 keeps unknown
    fields and otherwise ignores them, so each one parses."""
    declared = {field.number for field in message_class.DESCRIPTOR.fields}
    numbers = (st.integers(1, 40) | st.integers(1, _MAX_FIELD_NUMBER)).filter(
        lambda n: n not in declared)
    return st.lists(_wire_field(numbers, depth), max_size=6).map(b"".join)
