"""`roll train rlvr`: RL with verifiable rewards.

What is rlvr's own: the prompts (data/, chat templates, images), the reward stage, the
rollout source (the RLVR scheduler, rollout/scheduler.py, or with
`rollout.async_generation_ratio > 0` the async producer, rollout/async_scheduler.py),
validation on held-out prompts, the recipe checks and the `--dry-run` rows. The loop itself
is pipelines/rl_loop.py, shared with `roll train agentic`::

    for step in run.steps(max_steps):
        groups  = scheduler.next_batch(step)          # generated + rewarded + filtered
        batch   = build_rl_batch(groups)              # exactly the generated token ids
        batch  += reference / old log-probs, values   # only what the algorithm needs
        batch  += compute_advantages(batch)           # algorithms/, pure
        metrics = update (critic first, ppo epochs)   # ppo_epochs x mini_batches updates
        sync_weights(actor_train -> actor_infer)      # policy version = step
        if validation due: metrics |= validate()
"""

from __future__ import annotations

import functools
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_core.backends.infer import Request, SamplingParams
from roll_core.backends.infer.base import PREFIX_CONTINUATION_BACKENDS
from roll_core.config.rlvr import RLVRConfig
from roll_core.data import (
    StatefulLoader,
    encode_chat_prompt,
    encode_prompt,
    is_local_path,
    load_rows,
    prompt_turns,
    require_columns,
    require_field,
    row_value,
)
from roll_core.data.chat import encode_chat_images, image_message
from roll_core.data.vision import BadImageError, VisionInputs, image_rows
from roll_core.engine import Cluster
from roll_core.engine.plan import Plan
from roll_core.errors import ConfigError, DataError
from roll_core.models import (
    check_chat_template_choice,
    load_tokenizer,
    resolve_model_path,
    resolve_tokenizer_path,
    use_chat_template,
)
from roll_core.models.loading import is_vision_model
from roll_core.models.vision import load_processor
from roll_core.pipelines import on_policy_distill as opd
from roll_core.pipelines import roles
from roll_core.pipelines.common import DriverLoop, RolePlan
from roll_core.pipelines.rl_iteration import sampling_params
from roll_core.pipelines.rl_loop import RLHooks, run_rl
from roll_core.rewards.router import check_dataset_domains
from roll_core.rollout.async_scheduler import (
    AsyncRolloutScheduler,
    check_prefix_support,
)
from roll_core.rollout.rewards import RewardStage
from roll_core.rollout.router import rollout_mode
from roll_core.rollout.scheduler import Prompt, RolloutScheduler, Sample
from roll_core.rollout.source import AsyncRLVRSource, RLVRSource


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
            f"n={r.n} x {r.prompts_per_step} prompts, {rollout_mode(r)}; " + placement(cfg, p),
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
    train: list[Prompt]
    eval: list[Prompt]
    stats: dict[str, int]
    teacher_prompts: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    """algorithm.on_policy_distill: each privileged teacher's prompt ids by prompt index."""


def _prompts(
    cfg: RLVRConfig, tokenizer: Any, source: Any, key: str, processor: Any = None
) -> tuple[list[Prompt], dict[str, int]]:
    d = cfg.data
    rows = load_rows(
        source.path, split=source.split, subset=source.subset, max_rows=source.max_rows, key=key
    )
    require_columns(rows, [d.prompt_key], what=f"the RL data ({key})")
    require_field(rows, d.answer_key, what=f"the RL data ({key})")
    images = image_rows(
        rows, column=d.image_key, processor=processor, data_path=source.path, model=cfg.model.path
    )
    if images is not None and d.chat_template == "none":
        raise ConfigError(
            f"{source.path} has images (column {d.image_key!r}), but data.chat_template is none: "
            "image placeholders are written by a chat template.",
            hint="Set data.chat_template: model (the default) or a template file.",
        )
    out: list[Prompt] = []
    stats = {"rows": 0, "dropped_too_long": 0, "dropped_empty": 0, "dropped_bad_image": 0}
    for index, row in enumerate(rows):
        stats["rows"] += 1
        prompt = _prompt_of(cfg, row, index, source.path)
        answer = row_value(row, d.answer_key)
        if prompt is None or answer in (None, ""):
            stats["dropped_empty"] += 1
            continue
        if d.answer_key != "answer":  # rewards read the reference from row["answer"]
            row = {**row, "answer": answer}
        vision = None
        if images is not None:
            try:
                pictures = images.read(row.get(d.image_key))
            except BadImageError as err:
                stats["dropped_bad_image"] += 1
                images.warn(index, err)
                continue
            if isinstance(prompt, list):
                raise DataError(
                    f"Row {index} of {source.path} has images and a conversation prompt "
                    f"(column {d.prompt_key!r} is a list of turns); image rows take a text "
                    "prompt.",
                    hint="Give image rows their prompt as text (see docs/vlm.md).",
                )
            row = {k: v for k, v in row.items() if k != d.image_key}  # decoded images stay out
            ids, vision = encode_image_prompt(images.processor, prompt, pictures, d.system_prompt)
        else:
            ids = encode_text_prompt(cfg, tokenizer, prompt)
        if len(ids) > d.max_prompt_length:
            stats["dropped_too_long"] += 1
            continue
        out.append(Prompt(index=len(out), prompt_ids=ids, row=row, vision=vision))
    if not out:
        raise DataError(
            f"no usable rows in {source.path} ({stats['dropped_empty']} empty, "
            f"{stats['dropped_too_long']} longer than data.max_prompt_length={d.max_prompt_length}"
            f", {stats['dropped_bad_image']} with an unreadable image).",
            hint="Check data.prompt_key / data.answer_key / data.image_key, or raise "
            "data.max_prompt_length.",
        )
    return out, stats


def _prompt_of(
    cfg: RLVRConfig, row: dict[str, Any], index: int, path: str
) -> str | list[dict[str, Any]] | None:
    """A row's prompt: its text, its conversation (a list of chat turns), or None when blank.
    Another type, or a conversation with `data.chat_template: none`, is an error."""
    key = cfg.data.prompt_key
    value = row.get(key)
    turns = prompt_turns(value, row=index, column=key, source=path)
    if turns is None:
        if value is not None and not isinstance(value, str):
            raise DataError(
                f"Row {index} of column {key!r} in {path} is a {type(value).__name__}; an RL "
                "prompt is text or a list of chat turns [{role, content}, ...].",
                hint="Point data.prompt_key at the prompt column, or fix the row.",
            )
        return value if value and value.strip() else None
    if not any(t["content"].strip() for t in turns):
        return None
    if cfg.data.chat_template == "none":
        raise ConfigError(
            f"column {key!r} of {path} holds conversations (lists of chat turns), but "
            "data.chat_template is none (raw prompts): a conversation is rendered by a chat "
            "template.",
            hint="Set data.chat_template: model (the default) or the path of a template file.",
        )
    return turns


def encode_text_prompt(cfg: RLVRConfig, tokenizer: Any, prompt: Any) -> list[int]:
    """The ids of a text prompt or a conversation (list of turns), as `data.chat_template` and
    `data.system_prompt` render it."""
    d = cfg.data
    if isinstance(prompt, list):
        return encode_chat_prompt(tokenizer, _with_system(prompt, d.system_prompt))
    if d.chat_template == "none":
        return list(tokenizer(prompt)["input_ids"])  # raw prompt: the tokenizer's own specials
    return list(encode_prompt(tokenizer, prompt, system=d.system_prompt))


def _with_system(turns: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """`data.system_prompt` before a conversation that has no system turn of its own."""
    if system is None or any(t["role"] == "system" for t in turns):
        return turns
    return [{"role": "system", "content": system}, *turns]


def encode_image_prompt(
    processor: Any, text: str, images: list[Any], system: str | None
) -> tuple[list[int], VisionInputs | None]:
    """Ids and vision inputs of one image row: [system?, user: images then text] + header."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    messages.append(image_message(text, len(images)))
    return encode_chat_images(processor, messages, images, add_generation_prompt=True)


def prepare(cfg: RLVRConfig) -> RLVRSetup:
    model_path = resolve_model_path(cfg.model.path)
    check_chat_template(cfg)
    tok_path = resolve_tokenizer_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path
    tokenizer = load_tokenizer(tok_path)
    use_chat_template(tokenizer, cfg.data.chat_template)  # a template file replaces the model's
    processor = load_processor(model_path, tokenizer) if is_vision_model(model_path) else None
    train, stats = _prompts(cfg, tokenizer, cfg.data.train, "data.train.path", processor)
    evals: list[Prompt] = []
    if cfg.data.eval is not None:
        evals, _ = _prompts(cfg, tokenizer, cfg.data.eval, "data.eval.path", processor)
        if cfg.eval.max_samples:
            evals = evals[: cfg.eval.max_samples]
    stage = RewardStage(cfg.reward, tokenizer=tokenizer, domains=_domains(cfg, train + evals))
    try:  # malformed rows (a code row's tests, ...) are a clear error at loading, not 0s later
        stage.router.check_rows(p.row for p in train + evals)
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


def _domains(cfg: RLVRConfig, prompts: list[Prompt]) -> set[str | None]:
    return {p.row.get(cfg.reward.domain_key) for p in prompts}


def check_data_domains(cfg: RLVRConfig) -> None:
    """The domains of local data against the reward sections, before any model or reward is
    built (`roll validate`, the dry run): a row whose domain has no reward, or a row without
    a domain when `reward.default_domain` is unset, is the ConfigError `prepare` would raise.
    Hub data (not downloaded here) and local paths that do not exist yet are left to the run."""
    sources = {"data.train.path": cfg.data.train, "data.eval.path": cfg.data.eval}
    rows = {}
    for key, source in sources.items():
        if source is None or not is_local_path(source.path):
            continue
        if Path(source.path).expanduser().exists():
            rows[key] = load_rows(
                source.path,
                split=source.split,
                subset=source.subset,
                max_rows=source.max_rows,
                key=key,
            )
    checks = [("reward", cfg.reward, list(rows))]  # as in `prepare`: all data, then eval's
    if cfg.eval.reward is not None and "data.eval.path" in rows:
        checks.append(("eval.reward", cfg.eval.reward, ["data.eval.path"]))
    for name, section, keys in checks:
        for key in keys:
            data, column = rows[key], section.domain_key
            values = data[column] if column in data.column_names else [None]
            check_dataset_domains(
                values,
                domains=section.domains,
                default_domain=section.default_domain,
                domain_key=column,
                where=f"{sources[key].path} ({key}, scored by {name})",  # type: ignore[union-attr]
            )


def placement(cfg: RLVRConfig, p: Plan) -> str:
    """Rollout/train placement in words; ConfigError for async on one shared device."""
    return roles.rollout_placement_of(cfg, p)


def check_chat_template(cfg: RLVRConfig) -> None:
    """`data.chat_template` against the tokenizer's files (no model or tokenizer is loaded):
    a missing template file, or `model` with a tokenizer that has no template, is a
    ConfigError at validation instead of a failure at run time."""
    check_chat_template_choice(
        cfg.data.chat_template,
        key="data.chat_template",
        tokenizer_name=cfg.model.tokenizer or cfg.model.path,
    )


def check_algorithm(cfg: RLVRConfig) -> None:
    """Algorithm choices this pipeline cannot run, as recipe errors (no model is loaded)."""
    algo = cfg.algorithm
    if algo.uses_critic and cfg.critic is None:
        raise ConfigError(
            "algorithm.adv_estimator=gae (the ppo preset) needs a critic, and the recipe has "
            "no `critic:` section.",
            hint="Add a `critic:` section to the recipe (`critic: {optim: {lr: 1.0e-5}}`, or "
            "`critic: {}` for the defaults; on the command line `critic.optim.lr=1e-5`), or "
            "use a critic-free estimator: grpo, dr_grpo, rloo, reinforce_plus_plus.",
        )
    if algo.needs_groups and cfg.rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator} compares the samples of a group, "
            f"but rollout.n is {cfg.rollout.n}.",
            hint="Set rollout.n to 2 or more (8 is common), or use adv_estimator=reinforce_plus_plus.",
        )


class PromptStream:
    """An endless, resumable stream of training prompts (one loader 'batch' = one prompt)."""

    def __init__(self, prompts: list[Prompt], *, seed: int, shuffle: bool) -> None:
        self.prompts = prompts
        self.loader = StatefulLoader(len(prompts), 1, seed=seed, shuffle=shuffle)

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> Prompt:
        return self.prompts[next(self.loader)[0]]


def validate(
    cfg: RLVRConfig, setup: RLVRSetup, rl: roles.RLRoles, rewards: RewardStage
) -> dict[str, float]:
    params = SamplingParams(
        max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
        temperature=cfg.eval.temperature,
        stop=tuple(cfg.rollout.stop),
    )
    infer = rl.actor_infer
    chunk = max(cfg.rollout.chunk_size, 32)
    futures = []
    for k, i in enumerate(range(0, len(setup.eval), chunk)):
        reqs = [
            Request(p.index, p.prompt_ids, seed=cfg.seed + p.index, vision=p.vision)
            for p in setup.eval[i : i + chunk]
        ]
        futures.append(infer.at(k % infer.world_size).generate(reqs, params))
    completions = [c for f in futures for c in f.result()]
    scored = []
    for p, c in zip(setup.eval, completions, strict=True):
        sample = Sample(
            uid=p.index,
            group=p.index,
            prompt=p,
            response_ids=c.response_ids,
            log_probs=c.log_probs,
            finish_reason=c.finish_reason,
            policy_version=c.policy_version,
        )
        sample.reward, sample.reward_info = rewards.score_sample(sample)
        scored.append(sample)
    return rewards.eval_metrics(scored, prefix="eval")


def _data_note(setup: RLVRSetup) -> str:
    """The console line on the data a run trains on (rows used, dropped and why)."""
    stats = setup.stats
    bad_image = stats.get("dropped_bad_image")
    return (
        f"data: {stats['rows']} rows, {len(setup.train)} prompts used "
        f"({stats['dropped_too_long']} too long, {stats['dropped_empty']} empty"
        + (f", {bad_image} with an unreadable image" if bad_image else "")
        + f"); eval {len(setup.eval)} prompts"
    )


def run(cfg: RLVRConfig, setup: RLVRSetup, loop: DriverLoop) -> dict[str, float]:
    loop.console_note(_data_note(setup))
    domains = _domains(cfg, setup.train + setup.eval)
    train_stage = RewardStage(cfg.reward, tokenizer=setup.tokenizer, domains=domains)
    # validation scores apart (eval.reward, else reward): never in the training metrics
    eval_stage = RewardStage(
        cfg.eval.reward or cfg.reward, tokenizer=setup.tokenizer, domains=_domains(cfg, setup.eval)
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
            evaluate = functools.partial(validate, cfg, setup, rl, eval_rewards)
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
    """The rollout source: the synchronous scheduler, or the async producer."""
    scheduler = _make_scheduler(cfg, rl.actor_infer, stream, rewards, sampling_params(cfg.rollout))
    kind = AsyncRLVRSource if isinstance(scheduler, AsyncRolloutScheduler) else RLVRSource
    return kind(
        scheduler,  # type: ignore[arg-type]
        prompts=setup.train,
        pad_id=setup.tokenizer.pad_token_id,
        step_metrics=rewards.step_metrics,
    )


def _make_scheduler(
    cfg: RLVRConfig,
    infer: Cluster,
    stream: PromptStream,
    rewards: RewardStage,
    params: SamplingParams,
) -> RolloutScheduler | AsyncRolloutScheduler:
    """The synchronous scheduler, or (async_generation_ratio > 0) the async producer."""
    r = cfg.rollout
    common: dict[str, Any] = dict(
        infer=infer,
        prompts=stream,
        reward_fn=rewards.score_sample,
        params=params,
        n=r.n,
        prompts_per_step=r.prompts_per_step,
        deterministic=r.deterministic,
        chunk_size=r.chunk_size,
        max_chunks_in_flight=r.max_chunks_in_flight,
        group_affinity=r.group_affinity,
        request_timeout_s=r.request_timeout_s,
        dynamic_sampling=cfg.algorithm.dynamic_sampling,
        max_additional_prompts=r.max_additional_prompts,
        reward_workers=r.reward_workers,
        seed=cfg.seed,
    )
    if r.async_generation_ratio == 0:
        return RolloutScheduler(**common)
    prefix = cfg.actor_infer.backend in PREFIX_CONTINUATION_BACKENDS
    return AsyncRolloutScheduler(
        **common,
        async_generation_ratio=r.async_generation_ratio,
        partial_rollout=check_prefix_support(
            cfg.actor_infer.backend,
            prefix,
            partial_rollout=r.partial_rollout,
            allow_fallback=r.partial_rollout_fallback,
        ),
    )
