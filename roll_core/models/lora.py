"""LoRA adapters through `peft`: attach, save/load the adapters alone, export merged weights.

`peft` is the reference implementation of LoRA (arXiv 2106.09685) that vLLM, TRL and the hub
understand: its adapter files (`adapter_config.json` + `adapter_model.safetensors`) load in
any of them, so roll uses it instead of hand-written low-rank layers. What roll adds:

* :func:`apply_lora` checks every ``target_modules`` entry against the model's linear layers
  first (peft silently skips names that match nothing when another name matches) and raises a
  :class:`~roll_core.errors.ConfigError` listing the linear layers that exist;
* :func:`merged_state_dict` computes ``W + (alpha / r) * B @ A`` for every adapted layer
  *without* touching the live model (peft's ``merge_and_unload`` replaces the layers in place,
  and ``unmerge`` is not bitwise exact), so exporting mid-run never changes training.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from roll_core.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ADAPTER_NAME = "default"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Full names of every ``nn.Linear`` in ``model``, in module order."""
    return [name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _kinds(names: Sequence[str]) -> list[str]:
    """Distinct linear-layer names with layer numbers removed (``self_attn.q_proj``)."""
    seen: dict[str, None] = {}
    for name in names:
        parts = [p for p in name.split(".") if not p.isdigit()]
        seen.setdefault(".".join(parts[-2:]) if len(parts) > 1 else parts[-1])
    return list(seen)


def check_lora_targets(model: torch.nn.Module, target_modules: Sequence[str] | str) -> None:
    """Raise a ConfigError naming each target that matches no linear layer of ``model``."""
    if target_modules == "all-linear":
        return
    names = linear_module_names(model)
    missing = [t for t in target_modules if not any(_matches(n, t) for n in names)]
    if not target_modules or missing:
        shown = ", ".join(repr(t) for t in missing) or "(an empty list)"
        raise ConfigError(
            f"actor_train.lora.target_modules: {shown} matches no linear layer of the model. "
            f"Its linear layers are: {', '.join(_kinds(names))} "
            f"({len(names)} in all, e.g. {names[0] if names else 'none'}).",
            hint="Use names from that list (a suffix such as q_proj matches it in every "
            "layer), or `all-linear`.",
        )


def check_lora_targets_from_config(model_path: str, target_modules: Sequence[str] | str) -> None:
    """:func:`check_lora_targets` on a weightless copy of the model at ``model_path``.

    The model is built on the meta device from its config, so this costs no memory and no
    weight loading: pipelines call it before a run directory exists.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_path)
    # a vision-language model: the whole model, so vision-tower names (qkv, attn.proj) count
    vision = getattr(config, "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto.from_config(config)
    check_lora_targets(skeleton, target_modules)


def apply_lora(
    model: PreTrainedModel,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str] | str,
) -> Any:
    """Wrap ``model`` in a peft model with fresh adapters (A random from the torch RNG, B 0).

    Only the adapters require gradients afterwards; the returned model's forward equals the
    base model's until B moves away from 0.
    """
    from peft import LoraConfig, get_peft_model

    check_lora_targets(model, target_modules)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft says int; scale is alpha / r
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config, adapter_name=ADAPTER_NAME)


def save_adapter(model: Any, path: Path) -> None:
    """Write the adapters only (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)


def load_adapter(model: Any, path: Path) -> None:
    """Load adapter weights written by :func:`save_adapter` into ``model``'s adapters, exactly."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    expected = set(get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME))
    state = load_file(str(path / ADAPTER_WEIGHTS), device=str(next(model.parameters()).device))
    if set(state) != expected:
        raise CheckpointError(
            f"adapter checkpoint {path} does not match the model's adapters: missing "
            f"{sorted(expected - set(state))[:3]}, unexpected {sorted(set(state) - expected)[:3]}.",
            hint="Resume with the actor_train.lora settings the run started with.",
        )
    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER_NAME)
    if getattr(result, "unexpected_keys", None):
        raise CheckpointError(f"adapter checkpoint {path} has unexpected keys.")


@torch.no_grad()
def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded in: ``W + scale * B @ A``.

    Keys are those of the plain model (``...q_proj.weight``); the live model is not changed.
    """
    return dict(iter_merged(model))


@torch.no_grad()
def iter_merged(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`merged_state_dict` one tensor at a time, in state-dict order: an adapted
    layer's merged weight is computed when it is reached (weight sync streams these without
    holding the merged model)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted: dict[str, Any] = {
        f"{name}.weight": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A
    }
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        if plain in adapted:
            delta = cast(Any, adapted[plain]).get_delta_weight(ADAPTER_NAME)
            yield plain, value + delta.to(value.dtype)
        else:
            yield plain, value


def export_merged(model: Any, path: Path) -> None:
    """Save ``model`` with adapters merged as a plain Hugging Face model into ``path``, and the
    adapters themselves into ``path/adapter/`` (for engines that serve LoRA adapters)."""
    path.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model()
    base.save_pretrained(path, state_dict=merged_state_dict(model), safe_serialization=True)
    save_adapter(model, path / "adapter")
