"""YAML recipe -> typed config, with `a.b.c=value` overrides and readable errors.

Every error names the file, the key path, what was expected and, for a typo, the closest
valid key: ``recipe.yaml: trainer.max_step: unknown key; did you mean trainer.max_steps?``
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from pydantic import BaseModel, ValidationError

from roll_core.config.recipes import PIPELINES, Recipe
from roll_core.config.schema import Strict
from roll_core.errors import ConfigError, UsageError

C = TypeVar("C", bound=BaseModel)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a recipe file into a dict; a missing file or bad YAML is a clear error."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise UsageError(
            f"recipe file {p} {what}.",
            hint="Pass the path of a YAML recipe, e.g. `roll sft recipes/tiny-arith-sft.yaml`.",
        )
    try:
        text = p.read_text()
        _reject_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), (), p)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(
            f"{p}: YAML syntax error{where}: {problem}.",
            hint="Fix the YAML (indentation, a missing ':' or an unclosed quote are common).",
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read recipe {p}: {err}.") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}: a recipe is a mapping of sections (model:, data:, trainer: ...), "
            f"not a {type(data).__name__}."
        )
    return data


def _reject_duplicate_keys(node: Any, path: tuple[str, ...], source: Path) -> None:
    """A key given twice in one mapping (a repeated `max_steps:` or a second `trainer:`
    section) is an error naming both lines; YAML loaders would keep the last one silently."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _reject_duplicate_keys(item, (*path, str(i)), source)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
        line = key_node.start_mark.line + 1
        if key is not None and key != "<<":
            if key in seen:
                what = "section" if isinstance(value_node, yaml.MappingNode) else "key"
                dotted = ".".join((*path, key))
                raise ConfigError(
                    f"{source}: {what} {dotted} is given twice (line {seen[key]} and line "
                    f"{line}); YAML would silently keep only the second.",
                    hint="Merge the two sections into one."
                    if what == "section"
                    else "Delete the one you do not mean.",
                )
            seen[key] = line
        _reject_duplicate_keys(value_node, (*path, key or "?"), source)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, in place.

    A numeric part indexes a list that is already there: ``envs.0.eval_episodes=16`` sets
    ``eval_episodes`` of the first env; an index past the end is an error naming the length.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                f"override {item!r} is not of the form key.path=value.",
                hint="Example: `trainer.max_steps=100` or `actor_train.optim.lr=1e-4`.",
            )
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        node: Any = data
        parts = key.split(".")
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if isinstance(node, list):
                index = _list_index(item, parts[:depth], part, len(node))
                if last:
                    node[index] = value
                else:
                    node = node[index]
                continue
            if last:
                node[part] = value
                break
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict | list):
                prefix = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {item!r}: {prefix} is a value, not a section.")
            node = child
    return data


def _list_index(item: str, path: list[str], part: str, length: int) -> int:
    """The list index ``part`` of an override, checked against the list's ``length``."""
    where = ".".join(path)
    valid = f"0 to {length - 1}" if length else "none: the list is empty"
    if not part.isdigit():
        raise ConfigError(
            f"override {item!r}: {where} is a list, so the next part must be an index "
            f"({valid}), not {part!r}.",
            hint=f"Example: `{where}.0.<key>=value` changes the first item.",
        )
    index = int(part)
    if index >= length:
        raise ConfigError(
            f"override {item!r}: {where} has {length} item(s), so index {index} does not exist "
            f"(valid: {valid}).",
            hint="Add the item to the recipe file; overrides change items, they do not add them.",
        )
    return index


def _model_in(ann: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the model class inside an annotation, whether a key/index segment comes first)."""
    origin = getattr(ann, "__origin__", None)
    if origin in (dict, list, tuple):
        args = getattr(ann, "__args__", ())
        inner, _ = _model_in(args[-1]) if args else (None, False)
        return inner, True
    for cand in (ann, *getattr(ann, "__args__", ())):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand, False
        if getattr(cand, "__origin__", None) in (dict, list, tuple):
            return _model_in(cand)
    return None, False


def _model_at(schema: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The schema class that owns the last element of `loc` (None when not a model).

    Mapping keys (`reward.domains.<name>`) and list indices in `loc` are stepped over.
    """
    model: type[BaseModel] | None = schema
    parts = list(loc[:-1])
    while parts:
        part = parts.pop(0)
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model, keyed = _model_in(model.model_fields[part].annotation)
        if keyed and parts:
            parts.pop(0)
    return model


def _describe(err: Any, schema: type[BaseModel]) -> str:
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        owner = _model_at(schema, loc)
        removed = getattr(owner, "removed_keys", {}).get(str(loc[-1]))
        if removed:  # a key an earlier roll had: say what replaced it
            return f"{path}: {removed}"
        valid = list(owner.model_fields) if owner else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        prefix = ".".join(str(p) for p in loc[:-1])
        if close:
            suggestion = f"{prefix}.{close[0]}" if prefix else close[0]
            return f"{path}: unknown key; did you mean {suggestion}?"
        return f"{path}: unknown key; valid keys here: {', '.join(valid)}."
    if kind == "missing":
        return f"{path}: required key is missing."
    if kind == "value_error":  # a check across fields: its message says it all
        msg = str(err["msg"]).removeprefix("Value error, ")
        return msg if not loc else f"{path}: {msg}"
    got = err.get("input")
    shown = repr(got) if not isinstance(got, dict) else "a mapping"
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{path}: {err['msg'].rstrip('.')} (got {shown})."


def validate(schema: type[C], data: dict[str, Any], *, source: str) -> C:
    """Validate `data` against `schema`; raise a ConfigError listing every problem."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(e, schema) for e in exc.errors()]
        head = f"{source}: {lines[0]}" if len(lines) == 1 else f"{source}: {len(lines)} problems:"
        body = "" if len(lines) == 1 else "\n" + "\n".join(f"  - {line}" for line in lines)
        raise ConfigError(
            head + body,
            hint="See docs/config.md for every key, or `roll validate RECIPE` after fixing.",
        ) from None


COMMANDS = {"rlvr": "roll train rlvr", "agentic": "roll train agentic"}
"""The command of pipelines whose command is not `roll <pipeline>`."""


def schema_for(data: dict[str, Any], *, source: str, expected: str | None = None) -> type[Strict]:
    """Pick the pipeline schema from the recipe's `pipeline:` key (or the command's)."""
    name = data.get("pipeline", expected)
    if name is None:
        raise ConfigError(
            f"{source}: the recipe has no `pipeline:` key.",
            hint=f"Add `pipeline: NAME` with one of: {', '.join(PIPELINES)}.",
        )
    if name == "serve":  # not a training pipeline: its own command and schema (config/serve.py)
        raise ConfigError(
            f"{source}: a `pipeline: serve` recipe is run and checked by `roll serve`.",
            hint="Check it with `roll serve RECIPE --dry-run` (see docs/serve.md).",
        )
    if name not in PIPELINES:
        close = difflib.get_close_matches(str(name), list(PIPELINES), n=1)
        extra = f" Did you mean {close[0]}?" if close else ""
        raise ConfigError(
            f"{source}: pipeline: unknown pipeline {name!r}.{extra}",
            hint=f"Valid pipelines: {', '.join(PIPELINES)}.",
        )
    if expected is not None and name != expected:
        raise ConfigError(
            f"{source}: this recipe is for `{name}`, not `{expected}`.",
            hint=f"Run it with `{COMMANDS.get(name, 'roll ' + name)}`, or fix `pipeline:`.",
        )
    return PIPELINES[name]


def load_recipe(
    path: str | Path, overrides: list[str] | None = None, *, expected: str | None = None
) -> Recipe:
    """Read, override and validate a recipe; `expected` is the pipeline the command runs."""
    return load_config(read_yaml(path), list(overrides or []), source=str(path), expected=expected)


def load_config(
    data: dict[str, Any], overrides: list[str], *, source: str, expected: str | None = None
) -> Recipe:
    """Override and validate a recipe's mapping: a recipe file's (`roll validate`, `--dry-run`,
    a new run) or a run's config.yaml (`roll resume`), through this one function.

    The result is checked to resolve again: its config.yaml (`dump_config`) read back by this
    function gives the same config. A run is never started that `roll resume` would refuse or
    read otherwise (a default a check took for the user's own setting); that is roll's bug,
    reported as one."""
    data = apply_overrides(data, overrides)
    schema = schema_for(data, source=source, expected=expected)
    data.setdefault("pipeline", expected or data.get("pipeline"))
    cfg = validate(schema, data, source=source)
    _check_resolves_again(cfg, schema, source)
    return cast(Recipe, cfg)  # the schema of its `pipeline:` (config/recipes.py)


def _check_resolves_again(cfg: Strict, schema: type[Strict], source: str) -> None:
    try:
        again = validate(schema, yaml.safe_load(dump_config(cfg)), source="its config.yaml")
    except ConfigError as err:
        problem = f"it is refused: {err.message}"
    else:
        if again.model_dump() == cfg.model_dump():  # every value (not private notes)
            return
        keys = _differences(cfg.model_dump(mode="json"), again.model_dump(mode="json"))
        problem = f"it reads back otherwise at {', '.join(keys) or 'values YAML writes alike'}"
    raise RuntimeError(  # not the user's input: the CLI reports it as a bug in roll
        f"{source}: the resolved config a run writes into its config.yaml does not validate "
        f"again as `roll resume` reads it ({problem}); a run that could not resume is not "
        "started"
    )


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted keys at which two dumped configs differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in dict.fromkeys([*a, *b]):
            found += _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return found
    return [] if a == b else [prefix.rstrip(".")]


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as YAML (every default filled in), as written to the run directory."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
