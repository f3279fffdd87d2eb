"""Name -> function registries for the two real extension points: advantage estimators and
policy losses.

A recipe names an estimator or a loss (`algorithm.adv_estimator: grpo`); the pipeline looks it
up here. An unknown name is a :class:`~roll_core.errors.ConfigError` that lists the valid names
and suggests the closest one. User code can add entries with ``@REGISTRY.register("name")``.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from roll_core.errors import ConfigError

F = TypeVar("F", bound=Callable[..., object])


def unknown_name_error(kind: str, name: object, valid: list[str], *, key: str) -> ConfigError:
    """A ConfigError for an unknown `name` of `kind`, with the closest valid name and the list.

    `key` is the recipe key that holds the name (shown in the hint), e.g. `algorithm.kl.estimator`.
    """
    close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
    extra = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(
        f"unknown {kind} {name!r}.{extra}",
        hint=f"Set `{key}` to one of: {', '.join(valid)}.",
    )


class Registry(Generic[F]):
    """A mapping from names to functions with helpful errors for unknown names."""

    def __init__(self, kind: str, *, key: str) -> None:
        self.kind = kind
        self.key = key
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: add the function under `name` (a second function under one name is a bug)."""

        def add(fn: F) -> F:
            if name in self._entries and self._entries[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        """The function registered as `name`; ConfigError listing the valid names otherwise."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise unknown_name_error(self.kind, name, self.names(), key=self.key) from None

    def known_params(self) -> set[str]:
        """Keyword parameters taken by at least one registered function."""
        known: set[str] = set()
        for fn in self._entries.values():
            known |= _keyword_params(fn)[0]
        return known

    def call(self, fn: F, name: str, inputs: dict[str, Any]) -> Any:
        """Call `fn` (registered as `name`) with the inputs it accepts.

        One call site serves every registered function: inputs this function does not take, or
        that are None, are left out; a name that no registered function takes is a TypeError (a
        typo at the call site); a required input that is missing is a ValueError naming it.
        """
        what = f"{self.kind} {name!r}"
        unknown = sorted(set(inputs) - self.known_params())
        if unknown:
            raise TypeError(f"{what}: unexpected argument(s) {', '.join(unknown)}")
        names, required = _keyword_params(fn)
        given = {k: v for k, v in inputs.items() if k in names and v is not None}
        missing = sorted(required - set(given))
        if missing:
            raise ValueError(f"{what} needs {', '.join(missing)}")
        return fn(**given)

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _keyword_params(fn: Callable[..., object]) -> tuple[set[str], set[str]]:
    """(keyword-only parameters, the required ones) of a registered function."""
    params = inspect.signature(fn).parameters
    names = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    required = {n for n in names if params[n].default is inspect.Parameter.empty}
    return names, required
