"""Finding and loading models and tokenizers: builtin names, local directories, hub ids.

A model is named in one of three ways:

* ``builtin:NAME``: a built-in tiny model, materialized into the roll cache on first use;
* a local directory holding a Hugging Face model (``config.json`` + weights + tokenizer);
* a Hugging Face hub id (``org/name``), passed to ``from_pretrained`` unchanged.

Every failure a user can fix (a typo, a missing directory, no network) becomes a
:class:`~roll_core.errors.ModelError`. :func:`model_summary` reads only ``config.json`` and
never loads weights, for ``--dry-run``.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from roll_core.errors import ModelError
from roll_core.models.builtin import (
    BUILTIN_MODELS,
    BUILTIN_PREFIX,
    get_builtin,
    materialize_builtin,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Source = Literal["builtin", "local", "hub"]
_T = TypeVar("_T")


def resolve_model_path(name_or_path: str) -> str:
    """The path or hub id to hand to ``from_pretrained`` for ``name_or_path``.

    ``builtin:NAME`` becomes its materialized directory, a local model directory its absolute
    path; anything else that looks like a path must exist; the rest is a hub id, unchanged.
    """
    source = _classify(name_or_path)
    if source == "builtin":
        return str(materialize_builtin(name_or_path))
    if source == "local":
        return str(_local_model_dir(name_or_path))
    return name_or_path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these marks a directory as holding a tokenizer (save_pretrained writes the first two)."""


def resolve_tokenizer_path(name_or_path: str) -> str:
    """Like :func:`resolve_model_path`, but a local directory needs only tokenizer files
    (a tokenizer saved on its own, with no config.json or weights, is accepted)."""
    if _classify(name_or_path) != "local":
        return resolve_model_path(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and any((path / f).is_file() for f in TOKENIZER_FILES):
        return str(path.resolve())
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelError(
            f"tokenizer directory {path.absolute()} holds no tokenizer files "
            f"({', '.join(TOKENIZER_FILES)}).",
            hint="Point model.tokenizer to a directory written by tokenizer.save_pretrained(), "
            "or to a model directory.",
        )
    return resolve_model_path(name_or_path)  # the missing-path / file errors


def chat_template_status(name_or_path: str) -> bool | None:
    """Whether the tokenizer at ``name_or_path`` ships a chat template, read from its files
    without loading it (None: unknown, a hub id not in the local cache)."""
    source = _classify(name_or_path)
    if source == "builtin":
        return True  # the built-in tokenizer is ChatML (models/tokenizer.py)
    if source == "local":
        directory = Path(resolve_tokenizer_path(name_or_path))
        if (directory / "chat_template.jinja").is_file() or (
            directory / "chat_template.json"
        ).is_file():
            return True
        config = directory / "tokenizer_config.json"
        if not config.is_file():
            return None
        return bool(_read_config(config).get("chat_template"))
    from huggingface_hub import try_to_load_from_cache

    for name in ("chat_template.jinja", "tokenizer_config.json"):
        cached = try_to_load_from_cache(name_or_path, name)
        if isinstance(cached, str):
            if name.endswith(".jinja"):
                return True
            return bool(_read_config(Path(cached)).get("chat_template"))
    return None


def check_chat_template_choice(choice: str, *, key: str, tokenizer_name: str) -> None:
    """A recipe's chat-template choice (``model``: the tokenizer's own, ``none``: raw text, or
    the path of a Jinja template file) against the files, without loading the tokenizer: a
    missing template file, or ``model`` with a tokenizer that has no template, is a ConfigError
    naming ``key`` (``data.chat_template``, ``rollout.chat_template``)."""
    from roll_core.errors import ConfigError

    if choice == "none":
        return
    if choice != "model":
        if not Path(choice).is_file():
            raise ConfigError(
                f"{key}: no template file {choice} (resolved to {Path(choice).absolute()}).",
                hint="Give the path of a Jinja chat-template file or `model` (the tokenizer's "
                "own template)" + (" or `none` (raw prompts)." if key.startswith("data.") else "."),
            )
        return
    try:
        has_template = chat_template_status(tokenizer_name)
    except ModelError:  # a missing model is reported by its own check
        return
    if has_template is False:
        raise ConfigError(
            f"the tokenizer of {tokenizer_name} has no chat template, and {key} is `model` "
            "(the default), so the prompts cannot be rendered.",
            hint=(
                f"Set {key}: none to use the raw prompt text (base models), "
                if key.startswith("data.")
                else "Set "
            )
            + f"{key}: PATH to a Jinja template file, or model.tokenizer to a tokenizer that "
            "ships a template.",
        )


def use_chat_template(tokenizer: PreTrainedTokenizerBase, choice: str) -> None:
    """Apply a recipe's chat-template choice: a template file replaces the tokenizer's own."""
    if choice not in ("model", "none"):
        tokenizer.chat_template = Path(choice).read_text(encoding="utf-8")


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer of ``name_or_path`` (a model directory or a tokenizer-only one);
    its pad token falls back to the eos token."""
    from transformers import AutoTokenizer

    resolved = resolve_tokenizer_path(name_or_path)
    tokenizer = _load("tokenizer", name_or_path, resolved, AutoTokenizer.from_pretrained)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(
                f"the tokenizer of '{name_or_path}' has neither a pad token nor an eos token, "
                "so batches cannot be padded.",
                hint="Use a model whose tokenizer defines an eos token (every chat model does).",
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Load ``name_or_path`` as a causal LM in ``dtype`` on ``device``. Under bf16 autocast
    on CPU its ``sdpa`` attention then runs in float32 (roll_core/models/attention.py), in
    every roll process alike."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from roll_core.models.attention import use_float32_attention_on_cpu_autocast

    use_float32_attention_on_cpu_autocast()

    resolved = resolve_model_path(name_or_path)
    # a vision-language model: the full model (vision tower + LM), not its text part alone
    auto = AutoModelForImageTextToText if is_vision_model(name_or_path) else AutoModelForCausalLM

    def from_pretrained(path: str, **kwargs: Any) -> PreTrainedModel:
        return auto.from_pretrained(path, dtype=dtype, **kwargs)

    model = _load("model", name_or_path, resolved, from_pretrained)
    return model.to(device)  # type: ignore[arg-type]


def model_config(name_or_path: str) -> dict[str, Any]:
    """The ``config.json`` of a model as a dict, read without loading the model ({} for a hub
    id not in the local cache; a builtin's from its spec, nothing written)."""
    source = _classify(name_or_path)
    if source == "builtin":
        spec = get_builtin(name_or_path)
        arch = {"architectures": [spec.architecture], "model_type": spec.model_type}
        return {**spec.config_dict(), **arch}
    if source == "local":
        return _read_config(_local_model_dir(name_or_path) / "config.json")
    return _cached_hub_config(name_or_path)


def is_vision_model(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is a vision-language model (its config has a vision tower)."""
    return "vision_config" in model_config(name_or_path)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters of ``model``; tied weights count once."""
    return sum(p.numel() for p in model.parameters())


def model_summary(name_or_path: str) -> dict[str, Any]:
    """What is known about a model without loading weights (nor, for builtins, writing files).

    Returns ``name``, ``source`` (builtin / local / hub) and ``architecture``, ``num_layers``,
    ``hidden_size``, ``vocab_size``, ``approx_params``, ``context`` (max positions); these are ``None`` when unknown (a hub
    id not in the local Hugging Face cache: the network is never used).
    """
    source = _classify(name_or_path)
    return {"name": name_or_path, "source": source, **_summarize_config(model_config(name_or_path))}


def _classify(name_or_path: str) -> Source:
    if name_or_path.startswith(BUILTIN_PREFIX):
        return "builtin"
    if not name_or_path.strip():
        raise ModelError(
            "the model name is empty.",
            hint=f"Give a built-in model ({_builtin_names()}), a local model directory "
            "or a Hugging Face hub id such as Qwen/Qwen3-0.6B.",
        )
    if Path(name_or_path).expanduser().exists() or _looks_local(name_or_path):
        return "local"
    return "hub"


def _looks_local(name_or_path: str) -> bool:
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        return True
    # `runs/x` where `runs/` exists here is a path with a typo, not the hub repo `runs/x`.
    first = name_or_path.split("/", 1)[0]
    return "/" in name_or_path and Path(first).expanduser().exists()


def _local_model_dir(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelError(
            f"model path not found: {name_or_path} (resolved to {path.absolute()}).",
            hint="Check the path, or name a built-in model "
            f"({_builtin_names()}) or a Hugging Face hub id (org/name).",
        )
    if not path.is_dir():
        raise ModelError(
            f"model path {path.absolute()} is a file, but a model is a directory.",
            hint="Point to the directory that holds config.json, the weights and the tokenizer.",
        )
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model directory {path.absolute()} has no config.json, so it is not a Hugging Face "
            "model directory.",
            hint="A model directory holds config.json, the weights (*.safetensors) and the "
            "tokenizer files, as written by save_pretrained(); point to such a directory.",
        )
    return path.resolve()


def _load(what: str, name_or_path: str, resolved: str, loader: Callable[..., _T]) -> _T:
    from huggingface_hub.errors import EntryNotFoundError

    kwargs: dict[str, Any] = {}
    if not Path(resolved).is_dir() and not _hub_offline():
        host = hub_unreachable()
        if host is not None:  # one try, not a minute of retries inside from_pretrained
            if not _cached_hub_config(resolved):
                raise ModelError(
                    f"could not load the {what} of '{name_or_path}': the Hugging Face hub "
                    f"({host}) cannot be reached and the model is not in the local cache.",
                    hint="Check your network (or HF_ENDPOINT), download the model where the hub "
                    "is reachable, or use a local model directory or a built-in model: "
                    f"{_builtin_names()}.",
                )
            kwargs["local_files_only"] = True  # cached: use it without asking the hub
    try:
        return loader(resolved, **kwargs)
    except (OSError, ValueError, EntryNotFoundError) as err:
        raise _load_error(what, name_or_path, resolved, err) from err


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


HUB_PROBE_TIMEOUT_S = 5.0


@functools.cache
def hub_unreachable() -> str | None:
    """The hub's host when one TCP connection to it fails (within `HUB_PROBE_TIMEOUT_S`),
    else None. Asked once per process, so an offline machine fails in seconds instead of
    going through huggingface_hub's retries for every file of every model."""
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    parsed = urllib.parse.urlparse(endpoint)
    host = parsed.hostname or "huggingface.co"
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError:
        return f"{host}:{port}"
    return None


def _load_error(what: str, name_or_path: str, resolved: str, err: Exception) -> ModelError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if Path(resolved).is_dir():
        return ModelError(
            f"could not load the {what} from {resolved}: {reason}",
            hint="The directory must hold a complete Hugging Face model (config.json, "
            "*.safetensors weights, tokenizer files); re-save it with save_pretrained().",
        )
    return ModelError(
        f"could not load the {what} of '{name_or_path}' from the Hugging Face hub: the hub "
        f"could not be reached or has no such repository ({reason}).",
        hint="Check the id and your network (set HF_HUB_OFFLINE=1 to use only cached models), "
        f"or use a local model directory or a built-in model: {_builtin_names()}.",
    )


def _builtin_names() -> str:
    return ", ".join(f"{BUILTIN_PREFIX}{name}" for name in sorted(BUILTIN_MODELS))


def _read_config(config_file: Path) -> dict[str, Any]:
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelError(
            f"could not read {config_file}: {err}",
            hint="config.json must be the JSON file written by save_pretrained().",
        ) from err


def _cached_hub_config(repo_id: str) -> dict[str, Any]:
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id
        return {}
    if not isinstance(cached, str):
        return {}
    try:
        return json.loads(Path(cached).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _summarize_config(config: Mapping[str, Any]) -> dict[str, Any]:
    text = config.get("text_config") or config  # multimodal configs nest the language model
    architectures = config.get("architectures") or []
    vision = config.get("vision_config")
    summary = {
        "architecture": architectures[0] if architectures else config.get("model_type"),
        "num_layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "approx_params": _approx_params(text, vision=vision),
        "context": text.get("max_position_embeddings"),
    }
    if vision:  # a vision-language model: its vision tower's share of approx_params
        summary["vision_params"] = approx_vision_params(vision)
    return summary


def approx_vision_params(vision: Mapping[str, Any] | None) -> int | None:
    """Parameters of a Qwen2.5-VL vision tower (patch embedding, blocks, patch merger)."""
    if not vision:
        return None
    try:
        h, depth = int(vision["hidden_size"]), int(vision["depth"])
        inter = int(vision.get("intermediate_size") or 4 * h)
        patch, merge = int(vision["patch_size"]), int(vision.get("spatial_merge_size", 2))
        out = int(vision.get("out_hidden_size") or h)
    except (KeyError, TypeError, ValueError):
        return None
    embed = int(vision.get("in_channels", 3)) * int(vision.get("temporal_patch_size", 2))
    embed *= patch * patch * h
    block = 4 * h * h + 4 * h + 3 * h * inter + 2 * inter + h + 2 * h  # attn, mlp, 2 norms
    merged = h * merge * merge
    merger = h + merged * merged + merged + merged * out + out
    return embed + depth * block + merger


def _approx_params(
    config: Mapping[str, Any], vision: Mapping[str, Any] | None = None
) -> int | None:
    """Parameter count of a dense Llama/Qwen-style decoder (exact for Qwen3, MoE not counted),
    plus a Qwen2.5-VL vision tower when ``vision`` is its config."""
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        vocab = int(config["vocab_size"])
        inter = int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v projections
    if config.get("attention_bias"):
        attn += head_dim * (heads + 2 * kv_heads) + hidden
    elif vision:  # Qwen2-style language model of a VLM: q, k, v biases
        attn += head_dim * (heads + 2 * kv_heads)
    qk_norm = 2 * head_dim if config.get("model_type") == "qwen3" else 0  # q_norm, k_norm
    layer = attn + qk_norm + 3 * hidden * inter + 2 * hidden  # + gate/up/down MLP + 2 norms
    lm_head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + layers * layer + hidden + lm_head + (approx_vision_params(vision) or 0)
