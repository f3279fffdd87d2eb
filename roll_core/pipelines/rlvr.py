"""`roll train rlvr`: RL with verifiable rewards.

What is rlvr's own: the prompts (data/, chat templates, images), the reward stage, the
rollout source (one-turn groups of the one rollout producer, rollout/one_turn.py: synchronous,
or with `rollout.async_generation_ratio > 0` ahead of the trainer),
validation on held-out prompts and the `--dry-run` rows. Prompt loading is data/prompts.py,
the recipe checks pipelines/checks/rlvr.py, and the loop itself pipelines/rl_loop.py, shared
with `roll train agentic` (the loop's pseudo-code: docs/internals.md, "The loop").
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from roll_core.backends.infer import SamplingParams
from roll_core.backends.infer.base import PREFIX_CONTINUATION_BACKENDS
from roll_core.config.rlvr import RLVRConfig
from roll_core.data import Prompt, PromptStream, encode_text_prompt, load_prompts, prompts_note
from roll_core.engine.plan import Plan
from roll_core.models import (
    load_tokenizer,
    resolve_model_path,
    resolve_tokenizer_path,
    use_chat_template,
)
from roll_core.models.loading import is_vision_model
from roll_core.models.vision import load_processor
from roll_core.pipelines import on_policy_distill as opd
from roll_core.pipelines import roles
from roll_core.pipelines.checks.rlvr import check_algorithm, check_chat_template, check_data_domains
from roll_core.pipelines.common import DriverLoop, RolePlan
from roll_core.pipelines.rl_iteration import sampling_params
from roll_core.pipelines.rl_loop import RLHooks, run_rl
from roll_core.rollout.one_turn import prompt_producer
from roll_core.rollout.placement import check_prefix_support
from roll_core.rollout.rewards import RewardStage
from roll_core.rollout.router import Router, rollout_mode
from roll_core.rollout.source import RLVRSource
from roll_core.rollout.validation import score_prompts


def plan(cfg: RLVRConfig, p: Plan) -> list[RolePlan]:
    check_algorithm(cfg)
    check_chat_template(cfg)
    check_data_domains(cfg)
    r, algo = cfg.rollout, cfg.algorithm
    updates = cfg.trainer.ppo_epochs * cfg.trainer.mini_batches
    rows = [
        roles.actor_train_row(
            cfg, f"{r.n * r.prompts_per_step} samples/step, {updates} updates/step"
        ),
        roles.actor_infer_row(
            cfg,
            f"n={r.n} x {r.prompts_per_step} prompts, {rollout_mode(r)}; "
            + roles.rollout_placement_of(cfg, p),
        ),
    ]
    if algo.uses_reference:
        kl = f"KL {algo.kl.estimator} as {algo.kl.use_as}"
        rows.append(roles.frozen_row(cfg, "reference", "Reference", kl))
    rows += opd.plan_rows(cfg, roles.frozen_row)
    if roles.uses_critic(cfg):
        c = cfg.critic
        assert c is not None
        value = f"value model from {c.model_path or cfg.model.path}, lr {c.optim.lr:g}"
        rows.append(RolePlan("critic", "Critic", c.backend, 1, c.device, cfg.executor.type, value))
    rows.append(roles.weight_sync_row(cfg, p))
    rows.append(roles.colocation_row(cfg, p))
    domains = "domains: " + ", ".join(cfg.reward.domains)
    rows.append(
        RolePlan("rewards", "RewardRouter", "threads", r.reward_workers, "cpu", "driver", domains)
    )
    return rows


@dataclass
class RLVRSetup:
    model_path: str
    tokenizer_path: str
    tokenizer: Any
    train: Sequence[Prompt]
    eval: Sequence[Prompt]
    stats: dict[str, int]
    teacher_prompts: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    """algorithm.on_policy_distill: each privileged teacher's prompt ids by prompt index."""


def prepare(cfg: RLVRConfig) -> RLVRSetup:
    model_path = resolve_model_path(cfg.model.path)
    check_chat_template(cfg)
    tok_path = resolve_tokenizer_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path
    tokenizer = load_tokenizer(tok_path)
    use_chat_template(tokenizer, cfg.data.chat_template)  # a template file replaces the model's
    processor = load_processor(model_path, tokenizer) if is_vision_model(model_path) else None
    train, stats = load_prompts(cfg, tokenizer, cfg.data.train, "data.train.path", processor)
    evals: Sequence[Prompt] = []
    if cfg.data.eval is not None:
        evals, _ = load_prompts(cfg, tokenizer, cfg.data.eval, "data.eval.path", processor)
        if cfg.eval.max_samples:
            evals = evals[: cfg.eval.max_samples]
    stage = RewardStage(cfg.reward, tokenizer=tokenizer, domains=_domains(cfg, train, evals))
    try:  # malformed rows (a code row's tests, ...) are a clear error at loading, not 0s later
        stage.router.check_rows(p.row for p in itertools.chain(train, evals))
    finally:
        stage.close()
    if cfg.eval.reward is not None:
        stage = RewardStage(cfg.eval.reward, tokenizer=tokenizer, domains=_domains(cfg, evals))
        try:
            stage.router.check_rows(p.row for p in evals)
        finally:
            stage.close()
    check_algorithm(cfg)
    setup = RLVRSetup(model_path, tok_path, tokenizer, train, evals, stats)
    if cfg.algorithm.on_policy_distill is not None:
        opd.check_recipe(cfg, load=True)
        setup.teacher_prompts = opd.teacher_prompts(
            cfg.algorithm.on_policy_distill,
            train,
            prompt_key=cfg.data.prompt_key,
            encode=functools.partial(encode_text_prompt, cfg, tokenizer),
            source=cfg.data.train.path,
        )
    return setup


def _domains(cfg: RLVRConfig, *sets: Sequence[Prompt]) -> set[str | None]:
    return {p.row.get(cfg.reward.domain_key) for p in itertools.chain(*sets)}


def validate(
    cfg: RLVRConfig, setup: RLVRSetup, router: Router, rewards: RewardStage
) -> dict[str, float]:
    params = SamplingParams(
        max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
        temperature=cfg.eval.temperature,
        stop=tuple(cfg.rollout.stop),
    )
    chunk = max(cfg.rollout.chunk_size, 32)
    scored = score_prompts(
        router, setup.eval, params, rewards.score_sample, seed=cfg.seed, chunk=chunk
    )
    return rewards.eval_metrics(scored, prefix="eval")


def run(cfg: RLVRConfig, setup: RLVRSetup, loop: DriverLoop) -> dict[str, float]:
    loop.console_note(prompts_note(setup.stats, len(setup.train), len(setup.eval)))
    domains = _domains(cfg, setup.train, setup.eval)
    train_stage = RewardStage(cfg.reward, tokenizer=setup.tokenizer, domains=domains)
    # validation scores apart (eval.reward, else reward): never in the training metrics
    eval_stage = RewardStage(
        cfg.eval.reward or cfg.reward,
        tokenizer=setup.tokenizer,
        domains=_domains(cfg, setup.eval),
    )
    with closing(train_stage) as rewards, closing(eval_stage) as eval_rewards:
        stream = PromptStream(setup.train, seed=cfg.seed, shuffle=cfg.data.shuffle)
        loop.register("prompts", stream.loader)
        loop.expect_data(len(setup.train), "prompts")
        loop.register("rewards", rewards)
        paths = dict(model_path=setup.model_path, tokenizer_path=setup.tokenizer_path)
        with (
            roles.rl_roles(cfg, loop, **paths) as rl,
            closing(_source(cfg, setup, rl, stream, rewards)) as source,
        ):
            evaluate = functools.partial(validate, cfg, setup, source.router, eval_rewards)
            hooks = RLHooks(
                evaluate=evaluate if setup.eval else None,
                eval_at_start=bool(cfg.eval.every_steps and setup.eval),
                advantages=_distill_hook(cfg, setup, rl),
                tokenizer=setup.tokenizer,
            )
            return run_rl(cfg, rl, source, loop, hooks)


def _distill_hook(cfg: RLVRConfig, setup: RLVRSetup, rl: roles.RLRoles) -> Any:
    """algorithm.on_policy_distill's advantages (None: rlvr's estimator alone)."""
    distill = cfg.algorithm.on_policy_distill
    if distill is None:
        return None
    pad = setup.tokenizer.pad_token_id
    return opd.distill_advantages(
        cfg,
        distill,
        rl.teachers,
        setup.teacher_prompts,
        pad_id=pad,
        vocab_size=len(setup.tokenizer),
    )


def _source(
    cfg: RLVRConfig,
    setup: RLVRSetup,
    rl: roles.RLRoles,
    stream: PromptStream,
    rewards: RewardStage,
) -> RLVRSource:
    """The rollout source over the one producer (synchronous at ratio 0, async above)."""
    r = cfg.rollout
    prefix = cfg.actor_infer.backend in PREFIX_CONTINUATION_BACKENDS
    producer = prompt_producer(
        infer=rl.actor_infer,
        prompts=stream,
        reward_fn=rewards.score_sample,
        params=sampling_params(cfg.rollout),
        n=r.n,
        prompts_per_step=r.prompts_per_step,
        async_generation_ratio=r.async_generation_ratio,
        deterministic=r.deterministic,
        chunk_size=r.chunk_size,
        max_chunks_in_flight=r.max_chunks_in_flight,
        group_affinity=r.group_affinity,
        request_timeout_s=r.request_timeout_s,
        dynamic_sampling=cfg.algorithm.dynamic_sampling,
        max_additional_prompts=r.max_additional_prompts,
        reward_workers=r.reward_workers,
        seed=cfg.seed,
        partial_rollout=check_prefix_support(
            cfg.actor_infer.backend,
            prefix,
            partial_rollout=r.partial_rollout,
            allow_fallback=r.partial_rollout_fallback,
        ),
        by_index=setup.train,
    )
    return RLVRSource(
        producer,
        pad_id=setup.tokenizer.pad_token_id,
        step_metrics=rewards.step_metrics,
    )
