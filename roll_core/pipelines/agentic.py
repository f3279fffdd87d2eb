"""`roll train agentic`: multi-turn RL in text environments.

What is agentic's own: the envs, the rollout source (env groups of the one rollout producer,
rollout/agentic/episodes.py: env-level async episodes, G per group), the batch layout (StarPO: one row
per episode; GiGPO, `rollout.mode: step`: one row per turn, with GiGPO's advantages) and
validation on held-out env seeds. The recipe checks are pipelines/checks/agentic.py, the
optional warm start (SFT on scripted episodes, before step 1) pipelines/warm_start.py, and
the loop itself pipelines/rl_loop.py, shared with `roll train rlvr` (the loop's pseudo-code:
docs/internals.md, "The loop"; the warm start is its `before_first_sync` hook).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch

from roll_core.algorithms import clip_advantages
from roll_core.algorithms.gigpo import gigpo_advantages
from roll_core.backends.infer import SamplingParams
from roll_core.config.agentic import AgenticConfig, EnvEntry
from roll_core.data import Batch
from roll_core.engine.plan import Plan
from roll_core.envs import make_env
from roll_core.envs.agents import load_agent
from roll_core.errors import ConfigError
from roll_core.models import (
    load_tokenizer,
    resolve_model_path,
    resolve_tokenizer_path,
    use_chat_template,
)
from roll_core.models.loading import is_vision_model
from roll_core.models.vision import load_processor
from roll_core.pipelines import roles
from roll_core.pipelines.checks.agentic import (
    check_algorithm,
    check_chat_format,
    check_env,
    check_images,
    check_warm_start,
    template_policy,
)
from roll_core.pipelines.common import DriverLoop, RolePlan
from roll_core.pipelines.rl_iteration import RLState, sampling_params
from roll_core.pipelines.rl_loop import RLHooks, run_rl
from roll_core.pipelines.warm_start import warm_start_phase
from roll_core.rollout.agentic import (
    ChatFormat,
    EnvSpec,
    RolloutSettings,
    Trajectory,
    env_producer,
    episode_metrics,
    run_episodes,
)
from roll_core.rollout.agentic.agent_episode import openai_client
from roll_core.rollout.agentic.endpoint import check_port
from roll_core.rollout.producer import RolloutProducer
from roll_core.rollout.router import rollout_mode
from roll_core.rollout.source import AgenticSource


def plan(cfg: AgenticConfig, p: Plan) -> list[RolePlan]:
    roles.rollout_placement_of(cfg, p)  # async rollout must not share one device with training
    check_algorithm(cfg)
    check_images(cfg)
    check_warm_start(cfg)
    check_chat_format(cfg)
    r = cfg.rollout
    episodes = r.group_size * sum(e.groups_per_step for e in cfg.envs)
    rows = [
        roles.actor_train_row(cfg, f"{r.mode}-wise samples from {episodes} episodes/step"),
        roles.actor_infer_row(cfg, f"{rollout_mode(r)}, async ratio {r.async_generation_ratio}"),
    ]
    if cfg.algorithm.uses_reference:
        rows.append(roles.frozen_row(cfg, "reference", "Reference", "KL"))
    rows.append(roles.weight_sync_row(cfg, p))
    rows.append(roles.colocation_row(cfg, p))
    envs = ", ".join(f"{e.name} x{e.groups_per_step} groups" for e in cfg.envs)
    threads = min(
        r.max_concurrent_episodes, episodes + r.redundant_groups * len(cfg.envs) * r.group_size
    )
    what = f"{envs}; group size {r.group_size}; {r.redundant_groups} redundant groups/env"
    rows.append(RolePlan("envs", "EpisodeMembers", "threads", threads, "cpu", "driver", what))
    return rows


@dataclass
class AgenticSetup:
    model_path: str
    tokenizer_path: str
    tokenizer: Any
    max_context: int
    processor: Any = None  # a vision-language model's VisionProcessor (image observations)
    chat: ChatFormat | None = None  # the checked chat format (template policy for the log)


def prepare(cfg: AgenticConfig) -> AgenticSetup:
    check_algorithm(cfg)
    check_warm_start(cfg)
    shows_images = [check_env(entry, cfg.rollout.step_timeout_s) for entry in cfg.envs]
    model_path = resolve_model_path(cfg.model.path)
    tok_path = resolve_tokenizer_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path
    tokenizer = load_tokenizer(tok_path)
    check_images(cfg)
    if any(entry.agent is not None for entry in cfg.envs):
        check_port(cfg.rollout.endpoint_port)
        openai_client("http://127.0.0.1:1/v1", is_async=False, timeout=1.0).close()
    vision = is_vision_model(model_path)
    for i, entry in enumerate(cfg.envs):
        if shows_images[i] and not vision:  # e.g. a user env with render_image()
            raise ConfigError(
                f"envs[{i}] ({entry.name}) shows pictures (its observations carry images), "
                f"but model.path={cfg.model.path} is a text-only model: it cannot see them.",
                hint="Use a vision-language model (builtin:tiny-qwen2.5-vl, Qwen2.5-VL), or "
                "make the env's render_image() return None.",
            )
    processor = load_processor(model_path, tokenizer) if vision else None
    use_chat_template(tokenizer, cfg.rollout.chat_template)
    chat = check_chat_format(cfg, tokenizer)
    max_context = cfg.rollout.max_context or _model_context(model_path)
    return AgenticSetup(model_path, tok_path, tokenizer, max_context, processor, chat)


def _model_context(model_path: str) -> int:
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 2048))


def env_specs(cfg: AgenticConfig, *, validation: bool = False) -> list[EnvSpec]:
    """One spec per env entry; ``validation``: with its ``eval_options`` merged in."""
    specs = []
    for entry in cfg.envs:
        options = {**entry.options, **entry.eval_options} if validation else entry.options

        def factory(entry: EnvEntry = entry, options: dict[str, Any] = options) -> Any:
            if entry.agent is not None:
                raise TypeError(f"{entry.name} is an agent program, not a TextEnv")
            return make_env(entry.env_id, **options)

        agent = load_agent(entry.agent, options) if entry.agent is not None else None
        specs.append(
            EnvSpec(entry.name, factory, entry.system_prompt, entry.groups_per_step, agent)
        )
    return specs


def settings(cfg: AgenticConfig, setup: AgenticSetup) -> RolloutSettings:
    r = cfg.rollout
    return RolloutSettings(
        params=sampling_params(r),
        group_size=r.group_size,
        redundant_groups=r.redundant_groups,
        mode=r.mode,
        history_window=r.history_window,
        max_context=setup.max_context,
        step_timeout_s=r.step_timeout_s,
        episode_timeout_s=r.episode_timeout_s,
        max_replacements=r.group_size if r.max_replacements is None else r.max_replacements,
        max_concurrent_episodes=r.max_concurrent_episodes,
        deterministic=r.deterministic,
        chunk_size=r.chunk_size,
        max_chunks_in_flight=r.max_chunks_in_flight,
        request_timeout_s=r.request_timeout_s,
        async_generation_ratio=r.async_generation_ratio,
        turn_barrier=r.turn_barrier,
        seed=cfg.seed,
        endpoint_port=r.endpoint_port,
        served_model=cfg.model.path,
        agent_history=r.agent_history,
        agent_sampling=r.agent_sampling,
        agent_model_aliases=tuple(r.agent_model_aliases),
    )


# ---- validation -------------------------------------------------------------------------------
def validate(
    cfg: AgenticConfig, producer: RolloutProducer[Trajectory], specs: list[EnvSpec]
) -> dict[str, float]:
    params = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.eval.temperature,
        stop=tuple(cfg.rollout.stop),
    )
    start = time.perf_counter()
    trajs: list[Trajectory] = []
    for entry, spec in zip(cfg.envs, specs, strict=True):
        seeds = [cfg.eval.seed_start + i for i in range(entry.eval_episodes)]
        trajs += run_episodes(producer, spec, seeds, params)
    metrics = episode_metrics(trajs, prefix="eval")  # a failed episode counts as a failure
    metrics["eval/env_errors"] = float(sum(t.status == "error" for t in trajs))
    metrics["eval/env_timeouts"] = float(sum(t.status == "timeout" for t in trajs))
    metrics["eval/wall_s"] = time.perf_counter() - start
    return metrics


# ---- the loop -----------------------------------------------------------------------------------
def run(cfg: AgenticConfig, setup: AgenticSetup, loop: DriverLoop) -> dict[str, float]:
    specs = env_specs(cfg)
    loop.console_note(
        "envs: "
        + ", ".join(f"{e.name} ({e.groups_per_step} groups/step)" for e in cfg.envs)
        + f"; group size {cfg.rollout.group_size}, context {setup.max_context} tokens"
    )
    policy = template_policy(setup.chat, cfg.rollout.mode) if setup.chat else None
    if policy:
        loop.console_note(policy)
    paths = dict(model_path=setup.model_path, tokenizer_path=setup.tokenizer_path)
    with (
        roles.rl_roles(cfg, loop, **paths) as rl,
        closing(_source(cfg, setup, rl, specs, note=functools.partial(_warn, loop))) as source,
    ):
        evaluate = bool(cfg.eval.every_steps and any(e.eval_episodes for e in cfg.envs))

        eval_specs = env_specs(cfg, validation=True) if evaluate else specs

        def validation() -> dict[str, float]:
            try:
                return validate(cfg, source.producer, eval_specs)
            finally:
                source.show_faults()

        def warm(start: int) -> None:
            if start == 0 and cfg.warm_start.steps:
                warm_start_phase(cfg, setup, rl, source.producer, specs, loop, evaluate, eval_specs)

        hooks = RLHooks(
            evaluate=validation if evaluate else None,
            eval_at_start=evaluate,
            advantages=functools.partial(_gigpo, cfg) if cfg.rollout.mode == "step" else None,
            before_first_sync=warm,
            tokenizer=setup.tokenizer,
        )
        return run_rl(cfg, rl, source, loop, hooks)


def _warn(loop: DriverLoop, text: str) -> None:
    loop.console.print(f"warning: {text}", style="yellow", markup=False, soft_wrap=True)


def _source(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    rl: roles.RLRoles,
    specs: list[EnvSpec],
    note: Callable[[str], None] | None = None,
) -> AgenticSource:
    """Env groups of the rollout producer on actor_infer, as the loop's rollout source
    (``note``: where the first faults of each env are shown)."""
    producer = env_producer(
        infer=rl.actor_infer,
        tokenizer=setup.tokenizer,
        specs=specs,
        settings=settings(cfg, setup),
        processor=setup.processor,
        dynamic_sampling=cfg.algorithm.dynamic_sampling,
        max_additional_groups=cfg.rollout.max_additional_groups,
    )
    return AgenticSource(
        producer,
        pad_id=setup.tokenizer.pad_token_id,
        mode=cfg.rollout.mode,
        max_context=setup.max_context,
        gamma=cfg.gigpo.gamma,
        note=note,
    )


def _gigpo(cfg: AgenticConfig, batch: Batch, state: RLState | None = None) -> dict[str, float]:
    """GiGPO advantages (algorithms/gigpo.py) of a step-wise batch (rollout.mode: step)."""
    t = batch.tensors
    mask = t["response_mask"]
    adv, metrics = gigpo_advantages(
        episode_returns=torch.tensor(batch.meta["episode_returns"], dtype=torch.float32),
        episode_group_ids=torch.tensor(batch.meta["episode_groups"], dtype=torch.long),
        step_episode=t["step_episode"],
        step_returns=t["step_returns"],
        step_group_ids=t["anchor_ids"],
        omega=cfg.gigpo.omega,
        norm=cfg.gigpo.norm,
        eps=cfg.algorithm.adv_eps,
    )
    advantages = clip_advantages(adv.unsqueeze(-1) * mask, cfg.algorithm.advantage.clip)
    t["advantages"] = advantages * mask
    t["returns"] = t["step_returns"].unsqueeze(-1) * mask
    metrics["actor/advantage_mean"] = float((advantages * mask).sum() / mask.sum().clamp(min=1))
    metrics["actor/advantage_abs_max"] = float((advantages.abs() * mask).max())
    return metrics
