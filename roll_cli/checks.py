"""Checks `roll validate` / `--dry-run` and every training command make before a run: the
names and paths a run would trip over, found without loading a model.

* every model location of the recipe (``model.path``, ``model.tokenizer``, the distillation
  ``teacher``, the PPO ``critic.model_path``) is looked up the way the run looks it up (a
  tokenizer key accepts a tokenizer-only directory, as the run does): an
  unknown ``builtin:`` name or a directory that is not a model is an error; a local path that
  does not exist yet is a warning (an earlier command, e.g. the SFT warm start, may create it);
* every agentic env is built and reset once, and every agent program loaded and its
  ``make_task`` called on seed 0 (with the recipe's options), as the run does before it
  starts (``roll_core.pipelines.checks.agentic.check_env``): their errors are told as theirs;
* the sequence the recipe asks for must fit the model's context (``max_position_embeddings``):
  a longer one is a warning, since positions past the context are untrained.
* the GPU memory estimate (``--dry-run``'s memory rows): a GPU whose role needs more than
  ``executor.gpu_memory_gib`` even when it has the GPU to itself is a warning (a colocated
  plan that cannot fit by taking turns is refused by the plan itself);
* `resume_warnings`: a resume override that changes batch sizes (or the data, or the seed)
  gives a run that no longer matches one that never stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from roll_core.errors import ModelError

if TYPE_CHECKING:
    from roll_core.engine.plan import Plan

BITWISE_KEYS: tuple[str, ...] = (
    "seed",
    "data.",
    "trainer.micro_batch_size",
    "trainer.grad_accum_steps",
    "trainer.mini_batches",
    "trainer.ppo_epochs",
    "rollout.n",
    "rollout.prompts_per_step",
    "rollout.groups_per_step",
    "actor_train.world_size",
    "envs.",
)
"""Override keys (or key prefixes) whose change makes the resumed steps compute something else
than the run that never stopped would have."""


def model_locations(cfg: Any) -> list[tuple[str, str]]:
    """(key, location) of every model or tokenizer the recipe loads."""
    found = [("model.path", cfg.model.path)]
    if cfg.model.tokenizer:
        found.append(("model.tokenizer", cfg.model.tokenizer))
    teacher = getattr(cfg, "teacher", None)
    if teacher is not None:
        found.append(("teacher.path", teacher.path))
        if teacher.tokenizer:
            found.append(("teacher.tokenizer", teacher.tokenizer))
    critic = getattr(cfg, "critic", None)
    if critic is not None and getattr(critic, "model_path", None):
        found.append(("critic.model_path", critic.model_path))
    return found


def check_recipe(cfg: Any, plan: Plan | None = None) -> list[str]:
    """Raise the error a run would hit early; return warnings (see the module docstring).
    `plan`: the recipe's `make_plan` when the caller has it (made here otherwise)."""
    from roll_core.engine.plan import make_plan
    from roll_core.models import model_summary, resolve_tokenizer_path

    warnings: list[str] = []
    for key, location in model_locations(cfg):
        try:
            if key.endswith(".tokenizer"):  # a tokenizer saved on its own is enough here
                resolve_tokenizer_path(location)
                continue
            summary = model_summary(location)
        except ModelError as err:  # unknown builtin, a file, no config.json: the run fails too
            if location.startswith("builtin:") or Path(location).expanduser().exists():
                raise ModelError(f"{key}: {err.message}", hint=err.hint) from None
            warnings.append(f"{key}: {err.message} A run needs it to exist.")
            continue
        if key == "model.path":
            warnings += context_warnings(cfg, summary.get("context"))
    for entry in getattr(cfg, "envs", None) or []:
        from roll_core.pipelines.checks.agentic import check_env

        check_env(entry, cfg.rollout.step_timeout_s)  # the env's / agent's error, told as such
    return warnings + staleness_warnings(cfg) + memory_warnings(plan or make_plan(cfg))


def staleness_warnings(cfg: Any) -> list[str]:
    """Async generation trains stale samples: without a behaviour correction their
    probability ratio is taken against the trainer's policy only. Measured on
    tiny-frozenlake (docs/agentic.md, benchmark): `redundant_groups: 2` without a correction
    collapsed in seed 2 (15.6% and 0.4% held-out in two runs, sync 36.7%), with token TIS
    38.3%. Async recipes get token TIS unless they set `rollout_correction` (config/rlvr.py),
    so this warns only where the recipe turned it off (`rollout_correction: null`)."""
    rollout, algo = getattr(cfg, "rollout", None), getattr(cfg, "algorithm", None)
    ratio = getattr(rollout, "async_generation_ratio", 0) or 0
    if algo is None or ratio <= 0:
        return []
    if algo.rollout_correction is not None or algo.policy_loss == "decoupled_ppo":
        return []
    return [
        f"rollout.async_generation_ratio={ratio} with algorithm.rollout_correction: null: "
        f"samples up to {ratio} policy version(s) old are trained without a behaviour "
        "correction (the update's ratio is against the trainer's policy only). It can "
        "collapse a run (docs/agentic.md, the async benchmark: with rollout.redundant_groups, "
        "1 seed of 3 fell to 0-16% held-out while sync kept 37%). Remove the null to get the "
        "async default, {preset: token_tis} (or set policy_loss: decoupled_ppo)."
    ]


def memory_warnings(plan: Plan) -> list[str]:
    """One warning per group of GPUs where the largest role alone exceeds the GPU."""
    from roll_core.engine.placement import span

    gp = plan.gpu
    if gp is None:
        return []
    over: dict[tuple[str, float], list[int]] = {}
    for mem in gp.memory:
        for role, parts in mem.roles.items():
            need = sum(parts.values()) / 1024**3
            if need > gp.gpu_memory_gib:
                over.setdefault((role, round(need, 1)), []).append(mem.gpu)
    return [
        f"GPUs {span(gpus)}: {role} alone needs about {need:.1f} GiB at its peak (the memory "
        f"rows of the plan), more than executor.gpu_memory_gib={gp.gpu_memory_gib:g}; the run "
        "would run out of GPU memory. Shard it over more ranks (world_size, zero_stage 3 / "
        "fsdp2), lower trainer.micro_batch_size or the sequence length, or offload."
        for (role, need), gpus in over.items()
    ]


def context_warnings(cfg: Any, context: int | None) -> list[str]:
    """A warning when the longest sequence the recipe asks for exceeds the model's context."""
    if not context:
        return []
    data, rollout = getattr(cfg, "data", None), getattr(cfg, "rollout", None)
    asks: list[tuple[str, int]] = []
    if data is not None and getattr(data, "max_length", None):
        asks.append(("data.max_length", data.max_length))
    if data is not None and getattr(data, "max_prompt_length", None) and rollout is not None:
        total = data.max_prompt_length + rollout.max_new_tokens
        asks.append(("data.max_prompt_length + rollout.max_new_tokens", total))
    if rollout is not None and getattr(rollout, "max_context", None):
        asks.append(("rollout.max_context", rollout.max_context))
    return [
        f"{key} = {value} exceeds the model's context ({context} tokens, "
        "max_position_embeddings): positions past it were never trained."
        for key, value in asks
        if value > context
    ]


def resume_warnings(config_path: Path, overrides: list[str]) -> list[str]:
    """Warnings for overrides that change what the resumed steps compute (batch sizes...)."""
    from roll_core.config.loader import apply_overrides, read_yaml

    before = read_yaml(config_path)
    after = apply_overrides(read_yaml(config_path), list(overrides))
    out = []
    for item in overrides:
        key = item.partition("=")[0]
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in BITWISE_KEYS):
            continue
        old, new = _get(before, key), _get(after, key)
        if old != new:
            out.append(
                f"{key} changes from {old!r} to {new!r}: the resumed steps will not match a "
                "run that never stopped (resume is exact only with the same batch sizes, "
                "data and seed)."
            )
    return out


def _get(data: Any, key: str) -> Any:
    for part in key.split("."):
        if isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        elif isinstance(data, dict):
            data = data.get(part)
        else:
            return None
    return data
