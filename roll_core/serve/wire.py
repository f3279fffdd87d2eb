"""The protobuf messages of the Tinker API, read and written by hand.

The ``tinker`` client sends ``forward_backward`` bodies as protobuf (``tinker_public``
package, ``ForwardBackwardRequest``) and reads ``ForwardBackwardOutput`` and ``SampleResponse``
results as protobuf (``Accept: application/x-protobuf``). The few messages involved are
decoded and encoded here from the wire format itself (varints and length-delimited fields), so
the server needs neither the client package nor generated code. Field numbers are those of the
client's ``tinker/proto/tinker_public_pb2`` (tinker 0.38.0).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}  # DType enum (4, bfloat16: not sent)
FLOAT32, INT64 = 1, 2


class WireError(ValueError):
    """A body that is not the protobuf message it should be."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def fields(buf: bytes) -> list[tuple[int, Any]]:
    """(field number, value) of every field of one message: ints for varints, bytes for
    length-delimited fields, floats for fixed64 (doubles) and fixed32 (floats)."""
    out: list[tuple[int, Any]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, kind = key >> 3, key & 7
        value: Any
        if kind == 0:
            value, pos = _varint(buf, pos)
        elif kind == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise WireError("truncated field")
            value, pos = buf[pos : pos + size], pos + size
        elif kind == 1:
            (value,) = struct.unpack_from("<d", buf, pos)
            pos += 8
        elif kind == 5:
            (value,) = struct.unpack_from("<f", buf, pos)
            pos += 4
        else:
            raise WireError(f"unsupported wire type {kind}")
        out.append((number, value))
    return out


def _str(value: Any) -> str:
    return bytes(value).decode("utf-8")


def _int32(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def read_tensor(buf: bytes) -> np.ndarray:
    """A ``Tensor`` message as a dense numpy array (sparse CSR made dense, zeros elsewhere)."""
    dtype, shape, dense, csr = 0, [], b"", None
    for number, value in fields(buf):
        if number == 1:
            dense = value
        elif number == 2:
            csr = value
        elif number == 3:
            dtype = value
        elif number == 4:
            shape += [value] if isinstance(value, int) else _packed_varints(value)
    np_dtype = _DTYPES.get(dtype)
    if np_dtype is None:
        raise WireError(f"tensor dtype {dtype} is not float32, int64 or int32")
    if csr is None:
        arr = np.frombuffer(dense, dtype=np_dtype).copy()
        return arr.reshape(shape) if shape else arr
    parts = dict(fields(csr))
    values = np.frombuffer(parts.get(1, b""), dtype=np_dtype)
    crow = np.frombuffer(parts.get(2, b""), dtype=np.int64)
    col = np.frombuffer(parts.get(3, b""), dtype=np.int64)
    if len(shape) != 2:
        raise WireError("a sparse tensor needs a 2-D shape")
    out = np.zeros(shape, dtype=np_dtype)
    for row in range(len(crow) - 1):
        cols = col[crow[row] : crow[row + 1]]
        out[row, cols] = values[crow[row] : crow[row + 1]]
    return out


def _packed_varints(buf: bytes) -> list[int]:
    out, pos = [], 0
    while pos < len(buf):
        value, pos = _varint(buf, pos)
        out.append(value)
    return out


@dataclass
class Datum:
    """One training example: input tokens and named loss inputs."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackward:
    """A decoded ``ForwardBackwardRequest``."""

    model_id: str = ""
    seq_id: int = 0
    data: list[Datum] = field(default_factory=list)
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


def _read_chunk(buf: bytes) -> list[int]:
    for number, value in fields(buf):
        if number == 1:  # encoded_text: tokens as int32 bytes
            tokens = dict(fields(value)).get(1, b"")
            return np.frombuffer(tokens, dtype=np.int32).astype(np.int64).tolist()
        kind = {2: "image", 3: "audio (dmel)"}.get(number, f"field {number}")
        raise WireError(f"model_input chunks of kind {kind} are not served (text only)")
    return []


def _read_datum(buf: bytes) -> Datum:
    datum = Datum(tokens=[])
    for number, value in fields(buf):
        if number == 1:
            datum.tokens += _read_chunk(value)
        elif number == 2:
            entry = dict(fields(value))
            datum.inputs[_str(entry.get(1, b""))] = read_tensor(entry.get(2, b""))
    return datum


def read_forward_backward(body: bytes) -> ForwardBackward:
    """Decode a ``ForwardBackwardRequest`` body (WireError when it is not one)."""
    req = ForwardBackward()
    legacy: dict[str, float | str] = {}
    for number, value in fields(body):
        if number == 1:
            req.model_id = _str(value)
        elif number == 2:
            req.seq_id = _int32(value)
        elif number == 3:
            req.data.append(_read_datum(value))
        elif number == 4:
            req.loss_fn = _str(value)
        elif number == 5:
            entry = dict(fields(value))
            legacy[_str(entry.get(1, b""))] = float(entry.get(2, 0.0))
        elif number == 6:
            req.forward_only = bool(value)
        elif number == 7:
            entry = dict(fields(value))
            inner = dict(fields(entry.get(2, b"")))
            text = inner.get(2)
            req.loss_fn_config[_str(entry.get(1, b""))] = (
                _str(text) if text is not None else float(inner.get(1, 0.0))
            )
    for key, legacy_value in legacy.items():  # v2 wins where both are set
        req.loss_fn_config.setdefault(key, legacy_value)
    return req


# ---- writing ---------------------------------------------------------------------------------
def _key(number: int, kind: int) -> bytes:
    return _enc_varint((number << 3) | kind)


def _enc_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _bytes(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _enc_varint(len(payload)) + payload


def _int(number: int, value: int) -> bytes:
    return _key(number, 0) + _enc_varint(value)


def _double(number: int, value: float) -> bytes:
    return _key(number, 1) + struct.pack("<d", value)


def forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """A ``ForwardBackwardOutput``: one ``ArrayRecord`` holding every datum's 1-D outputs
    (float32), and the metrics."""
    record = b""
    names = list(outputs[0]) if outputs else []
    for name in names:
        arrays = [np.asarray(o[name], dtype=np.float32).reshape(-1) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        batched = (
            _bytes(1, b"".join(a.tobytes() for a in arrays))
            + _bytes(2, offsets.tobytes())
            + _int(3, FLOAT32)
        )
        record += _bytes(2, _bytes(1, name.encode()) + _bytes(2, batched))
    record += _int(3, len(outputs))
    msg = _bytes(1, b"ArrayRecord") + _bytes(2, record)
    for key, value in metrics.items():
        msg += _bytes(3, _bytes(1, key.encode()) + _double(2, float(value)))
    return msg


@dataclass
class Sequence:
    """One sampled sequence."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """A ``SampleResponse``: the sequences, and the prompt's log-probs when asked for (the
    first prompt token has none: NaN, as the client's JSON ``None`` becomes)."""
    msg = b""
    for seq in sequences:
        body = _int(1, 0 if seq.stop_reason == "stop" else 1)
        body += _bytes(2, np.asarray(seq.tokens, dtype=np.int32).tobytes())
        body += _bytes(3, np.asarray(seq.logprobs, dtype=np.float32).tobytes())
        msg += _bytes(1, body)
    if prompt_logprobs is not None:
        msg += _bytes(2, np.asarray(prompt_logprobs, dtype=np.float32).tobytes())
    return msg
