"""The config reference (`docs/config.md`), generated from the schema's field descriptions."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from roll_core.config.recipes import PIPELINES


def _type_name(ann: object) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(ann))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if ann is type(None):
        return "null"
    return getattr(ann, "__name__", str(ann))


def _submodel(ann: object) -> type[BaseModel] | None:
    for cand in (ann, *typing.get_args(ann)):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
    return None


def _default(field: typing.Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else f"`{value}`"
    if field.default is PydanticUndefined:
        return "**required**"
    return f"`{field.default}`"


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows: list[str] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = _submodel(field.annotation)
        desc = (field.description or "").replace("\n", " ")
        if sub is not None:
            rows.append(f"| `{path}` | section | {_default(field)} | {desc} |")
            rows.extend(_rows(sub, path + "."))
        else:
            rows.append(
                f"| `{path}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |"
            )
    return rows


def config_reference() -> str:
    """Markdown for every pipeline's schema: one table per pipeline."""
    out = [
        "# Config reference",
        "",
        "Generated from `roll_core/config/schema.py` by `roll schema`; a test fails",
        "when this page and the schema disagree. Unknown keys are errors in every section.",
        "Any key can be overridden on the command line: `roll sft RECIPE trainer.max_steps=10`.",
        "",
    ]
    for name, schema in PIPELINES.items():
        out += [f"## `pipeline: {name}`", "", (schema.__doc__ or "").strip(), ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        out += _rows(schema, "")
        out.append("")
    return "\n".join(out)
