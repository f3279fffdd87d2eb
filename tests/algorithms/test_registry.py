"""The name registries: registration, lookup errors and keyword dispatch."""

from __future__ import annotations

import pytest

from roll_core.algorithms.registry import Registry
from roll_core.errors import ConfigError


def make() -> Registry:
    reg: Registry = Registry("thing", key="algorithm.thing")

    @reg.register("alpha")
    def alpha(*, x: int, scale: int = 2) -> int:
        return x * scale

    @reg.register("beta")
    def beta(*, x: int, shift: int = 0) -> int:
        return x + shift

    return reg


def test_lookup_and_names() -> None:
    reg = make()
    assert reg.names() == ["alpha", "beta"] and "alpha" in reg and len(reg) == 2
    with pytest.raises(ConfigError) as info:
        reg.get("alpah")
    assert info.value.message == "unknown thing 'alpah'. Did you mean 'alpha'?"
    assert info.value.hint == "Set `algorithm.thing` to one of: alpha, beta."
    with pytest.raises(ConfigError) as far:
        reg.get("zzz")
    assert "Did you mean" not in far.value.message


def test_duplicate_name_is_refused() -> None:
    reg = make()
    with pytest.raises(ValueError, match="already registered"):
        reg.register("alpha")(lambda **_: 0)


def test_call_passes_only_what_a_function_takes() -> None:
    reg = make()
    # shift belongs to beta only: alpha ignores it; None means "use the default"
    assert reg.call(reg.get("alpha"), "alpha", {"x": 3, "shift": 5, "scale": None}) == 6
    assert reg.call(reg.get("beta"), "beta", {"x": 3, "shift": 5}) == 8
    with pytest.raises(TypeError, match="unexpected argument"):
        reg.call(reg.get("alpha"), "alpha", {"x": 3, "sclae": 4})
    with pytest.raises(ValueError, match="thing 'beta' needs x"):
        reg.call(reg.get("beta"), "beta", {"shift": 1})
