"""Request fields, as each API's adapter reads them: every field is either honoured or refused.

Each adapter keeps a table (``{field: Field}``) of every field its API defines; a field not in
the table is refused as OpenAI refuses it ("Unrecognized request argument supplied"), a field
whose row says ``refused`` is refused unless it has the value that asks for nothing (``null``,
``false``, the API's default). docs/agentic.md's field table is this data (a test keeps the two
the same). The readers below check one field's type and range, a 400 naming it otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from roll_core.rollout.agentic.endpoint.calls import EndpointError, bad

SAMPLING = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "min_p", "logit_bias", "seed")  # fmt: skip


@dataclass(frozen=True)
class Field:
    """One request field: ``honoured`` (``how``: what it does), ``sampling`` (the recipe's
    value only, see rollout.agent_sampling), ``accepted`` (identification or bookkeeping with no
    effect on a reply, in the API's own definition either), or ``refused`` (HTTP 400 unless it
    has one of the ``inert`` values, which ask for nothing)."""

    status: Literal["honoured", "sampling", "accepted", "refused"]
    how: str
    inert: tuple[Any, ...] = ()


def check_fields(body: Mapping[str, Any], table: Mapping[str, Field], api: str) -> None:
    """400 for a field the table does not know, or a refused field with a value that asks for
    something (``null`` always asks for nothing)."""
    for name, value in body.items():
        row = table.get(name)
        if row is None:
            raise bad(f"Unrecognized request argument supplied: {name} ({api}).", name)
        if row.status == "refused" and value is not None and value not in row.inert:
            raise bad(f"{name}: {row.how}", name)


def need_object(raw: Any, api: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise bad(
            f"the request body must be a JSON object ({api} request), got a JSON {_json_type(raw)}."
        )
    return raw


def get_int(body: Mapping[str, Any], name: str, *, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, got {_json_type(value)} {value!r}.", name)
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise bad(f"{name} must be {bound}, got {value}.", name)
    return value


def get_bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {_json_type(value)} {value!r}.", name)
    return value


def get_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad(f"{name} must be a string, got {_json_type(value)}.", name)
    return value


def get_stops(body: Mapping[str, Any], name: str, most: int | None) -> tuple[str, ...]:
    """``stop`` / ``stop_sequences``: a string or a list of non-empty strings."""
    value = body.get(name)
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"{name} must be a non-empty string or a list of non-empty strings.", name)
    if most is not None and len(stops) > most:
        raise bad(f"{name} takes at most {most} sequences, got {len(stops)}.", name)
    return tuple(stops)


def get_sampling(body: Mapping[str, Any], names: tuple[str, ...] = SAMPLING) -> dict[str, Any]:
    """The sampling fields a request set (numbers, ``logit_bias`` an object), type-checked;
    the session compares them with the recipe's sampling."""
    out: dict[str, Any] = {}
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if name == "logit_bias":
            if not isinstance(value, dict):
                raise bad("logit_bias must be an object of token id -> bias.", name)
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"{name} must be a number, got {_json_type(value)} {value!r}.", name)
        out[name] = value
    return out


def check_model(model: Any, names: tuple[str, ...]) -> str:
    """The model a request names: one the endpoint serves (404 ``model_not_found``)."""
    if not isinstance(model, str) or not model:
        raise bad("`model` is required: the name of the served model (GET /v1/models).", "model")
    if model not in names:
        raise EndpointError(
            404,
            f"The model `{model}` does not exist or you do not have access to it. This "
            f"endpoint serves the policy being trained as {', '.join(repr(n) for n in names)} "
            "(rollout.agent_model_aliases adds names).",
            "model_not_found",
            param="model",
        )
    return model


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def table_rows(table: Mapping[str, Field]) -> list[tuple[str, str, str]]:
    """``(field, status, how)`` rows of a field table, in the table's order (for the docs)."""
    return [(name, row.status, row.how) for name, row in table.items()]


def extra_keys(obj: Mapping[str, Any], allowed: set[str] | frozenset[str]) -> list[str]:
    """The keys of ``obj`` outside ``allowed`` that are set (a ``null`` asks for nothing: a
    client that dumps its objects with every optional field as null is not refused)."""
    return sorted(k for k, v in obj.items() if v is not None and k not in allowed)
