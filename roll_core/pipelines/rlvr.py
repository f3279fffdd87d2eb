"""`roll train rlvr`: RL with verifiable rewards.

The driver loop::

    for step in run.steps(max_steps):
        groups  = scheduler.next_batch(step)          # generated + rewarded + filtered
        batch   = build_rl_batch(groups)              # exactly the generated token ids
        batch  += reference.log_probs(batch)          # only if KL is used
        batch  += actor_train.log_probs(batch)        # old log-probs (and train/infer diff)
        batch  += critic.values(batch)                # only for gae (PPO)
        batch  += compute_advantages(batch)           # algorithms/, pure
        metrics = critic.train_step(batch)            # only for gae: clipped value loss
        metrics = actor_train.train_step(batch, "rl") # ppo_epochs x mini_batches updates
        sync_weights(actor_train -> actor_infer)      # policy version = step

Colocated roles take turns around these calls (pipelines/turns.py): after the rollout the
inference engine frees its memory and the training state comes back; after the update the
optimizer state leaves, the inference weights come back, the sync runs, then the params leave
and the KV cache comes back, as the recipe's `offload` switches choose.
        if validation due: metrics |= validate()
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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
from roll_core.engine.colocation import resolve_offload
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
from roll_core.pipelines import roles
from roll_core.pipelines.common import DriverLoop, RolePlan, check_same_data
from roll_core.pipelines.rl_iteration import (
    RLState,
    add_policy_log_probs,
    advantages_and_kl,
    correct_rollout,
    critic_batch_metrics,
    load_roles,
    record_weight_sync,
    reuses_update_log_probs,
    rl_batch_metrics,
    sampling_params,
    save_roles,
    sync_weights,
    update_policy,
    warn_logprob_gap,
)
from roll_core.pipelines.turns import Turns
from roll_core.rewards.router import check_dataset_domains
from roll_core.rollout.async_scheduler import (
    AsyncRolloutScheduler,
    check_prefix_support,
)
from roll_core.rollout.batch import build_rl_batch
from roll_core.rollout.rewards import RewardStage
from roll_core.rollout.router import rollout_mode
from roll_core.rollout.scheduler import Prompt, RolloutScheduler, Sample


def plan(cfg: RLVRConfig) -> list[RolePlan]:
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
            f"n={r.n} x {r.prompts_per_step} prompts, {rollout_mode(r)}; " + placement(cfg),
        ),
    ]
    if algo.uses_reference:
        kl = f"KL {algo.kl.estimator} as {algo.kl.use_as}"
        rows.append(roles.frozen_row(cfg, "reference", "Reference", kl))
    if roles.uses_critic(cfg):
        c = cfg.critic
        assert c is not None
        value = f"value model from {c.model_path or cfg.model.path}, lr {c.optim.lr:g}"
        rows.append(RolePlan("critic", "Critic", c.backend, 1, c.device, cfg.executor.type, value))
    rows.append(roles.weight_sync_row(cfg))
    rows.append(roles.colocation_row(cfg))
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
        elif isinstance(prompt, list):
            ids = encode_chat_prompt(tokenizer, _with_system(prompt, d.system_prompt))
        elif d.chat_template == "none":
            ids = list(tokenizer(prompt)["input_ids"])  # raw prompt: the tokenizer's own specials
        else:
            ids = encode_prompt(tokenizer, prompt, system=d.system_prompt)
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
    return RLVRSetup(model_path, tok_path, tokenizer, train, evals, stats)


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


def placement(cfg: RLVRConfig) -> str:
    """Rollout/train placement in words; ConfigError for async on one shared device."""
    return roles.rollout_placement_of(cfg)


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
    placement(cfg)  # async rollout must not share one device with training
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
    cfg: RLVRConfig, setup: RLVRSetup, clusters: dict[str, Cluster], rewards: RewardStage
) -> dict[str, float]:
    params = SamplingParams(
        max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
        temperature=cfg.eval.temperature,
        stop=tuple(cfg.rollout.stop),
    )
    infer = clusters["actor_infer"]
    chunk = max(cfg.rollout.chunk_size, 32)
    futures = []
    for k, i in enumerate(range(0, len(setup.eval), chunk)):
        reqs = [
            Request(p.index, p.prompt_ids, seed=cfg.seed + p.index, vision=p.vision)
            for p in setup.eval[i : i + chunk]
        ]
        futures.append(infer.submit(k % infer.world_size, "generate", reqs, params))
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
    rewards = RewardStage(
        cfg.reward, tokenizer=setup.tokenizer, domains=_domains(cfg, setup.train + setup.eval)
    )
    # validation scores apart (eval.reward, else reward): never in the training reward metrics
    eval_rewards = RewardStage(
        cfg.eval.reward or cfg.reward, tokenizer=setup.tokenizer, domains=_domains(cfg, setup.eval)
    )
    stream = PromptStream(setup.train, seed=cfg.seed, shuffle=cfg.data.shuffle)
    params = sampling_params(cfg.rollout)
    executor = roles.executor_for(cfg)
    scheduler = None
    choice = resolve_offload(cfg)
    try:
        with loop.phase("loading models"):
            clusters = roles.build_rl_roles(
                cfg,
                executor,
                model_path=setup.model_path,
                tokenizer_path=setup.tokenizer_path,
                sleep_mode=choice.infer_weights and cfg.actor_infer.backend == "vllm",
                run_dir=loop.run.dir,
            )
        turns = Turns(choice, clusters)  # colocated roles take turns (engine/colocation.py)
        scheduler = _make_scheduler(cfg, clusters, stream, rewards, params)
        rl_state = RLState(cfg.algorithm)
        reuse = reuses_update_log_probs(cfg) and not any(clusters["actor_train"].has_dropout())

        def save_state(ckpt: Path) -> dict[str, Any]:
            with turns.train_turn():
                save_roles(clusters, ckpt)
            held = scheduler.state_dict()  # async: groups not yet trained on
            if held:
                torch.save(held, ckpt / "async_rollout.pt")
            return {
                "prompts": stream.loader.state_dict(),
                "train_size": len(setup.train),
                "rl": rl_state.state_dict(),
                "rewards": rewards.state_dict(),
            }

        def load_state(ckpt: Path, state: dict[str, Any]) -> None:
            check_same_data(ckpt, state, size=len(setup.train), unit="prompts")
            load_roles(clusters, ckpt)
            stream.loader.load_state_dict(state["prompts"])
            saved = ckpt / "async_rollout.pt"
            if saved.exists():
                scheduler.load_state_dict(torch.load(saved), setup.train)
            rl_state.load_state_dict(state["rl"])
            rewards.load_state_dict(state["rewards"])

        start = loop.begin(save_state=save_state, load_state=load_state)
        sync_weights(clusters, version=start)
        record_weight_sync(clusters, loop)
        turns.start()
        if cfg.eval.every_steps and setup.eval and start == 0:
            loop.log_eval(0, lambda: validate(cfg, setup, clusters, eval_rewards))
        for step in loop.steps(start, cfg.trainer.max_steps):
            metrics = _train_step(cfg, setup, clusters, scheduler, step, rl_state, reuse, turns)
            warn_logprob_gap(loop, rl_state, metrics, cfg.trainer.warn_logprob_diff)
            metrics |= rewards.step_metrics()
            # version v = the weights after v updates; async: suspend -> sync -> resume;
            # colocated: optimizer off, inference weights back, sync, params off, KV back
            update = functools.partial(sync_weights, clusters, version=step)
            metrics |= scheduler.sync(turns.sync(update), step)
            loop.end_step(
                step,
                metrics,
                evaluate=(lambda s: validate(cfg, setup, clusters, eval_rewards))
                if setup.eval
                else None,
            )
        return loop.finish(export=lambda p: _export(clusters, turns, p))
    finally:
        if scheduler is not None:
            scheduler.close()
        rewards.close()
        eval_rewards.close()
        executor.shutdown()


def _export(clusters: dict[str, Cluster], turns: Turns, path: Path) -> None:
    with turns.train_turn():
        clusters["actor_train"].export(str(path))


def _make_scheduler(
    cfg: RLVRConfig,
    clusters: dict[str, Cluster],
    stream: PromptStream,
    rewards: RewardStage,
    params: SamplingParams,
) -> RolloutScheduler | AsyncRolloutScheduler:
    """The synchronous scheduler, or (async_generation_ratio > 0) the async producer."""
    r = cfg.rollout
    common: dict[str, Any] = dict(
        infer=clusters["actor_infer"],
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


def _train_step(
    cfg: RLVRConfig,
    setup: RLVRSetup,
    clusters: dict[str, Cluster],
    scheduler: RolloutScheduler | AsyncRolloutScheduler,
    step: int,
    rl_state: RLState,
    reuse_log_probs: bool = False,
    turns: Turns | None = None,
) -> dict[str, float]:
    timers: dict[str, float] = {}
    t = step_start = time.perf_counter()
    rollout = scheduler.next_batch(step)
    timers["time/rollout"] = time.perf_counter() - t
    if turns is not None:
        turns.to_train()  # colocated: inference frees its memory, training state comes back
    if not rollout.groups:
        raise DataError(
            "rollout produced no groups (every group was dropped by dynamic sampling).",
            hint="Raise rollout.max_additional_prompts or turn algorithm.dynamic_sampling off.",
        )
    batch = build_rl_batch(rollout.groups, pad_id=setup.tokenizer.pad_token_id)
    temp = cfg.rollout.temperature or 1.0
    timers |= add_policy_log_probs(clusters, batch, temp, old=not reuse_log_probs)
    if "critic" in clusters:
        t = time.perf_counter()
        values = torch.cat(clusters["critic"].values(batch))
        batch.tensors["values"] = values * batch.tensors["response_mask"]
        timers["time/values"] = time.perf_counter() - t
    metrics = advantages_and_kl(
        batch, cfg.algorithm, rl_state, max_new_tokens=cfg.rollout.max_new_tokens
    )
    metrics |= correct_rollout(batch, cfg.algorithm)
    if "critic" in clusters:
        metrics |= critic_batch_metrics(batch)
    t = time.perf_counter()
    metrics |= update_policy(cfg, clusters, batch, temp)
    timers["time/train"] = time.perf_counter() - t
    wall = time.perf_counter() - step_start
    generated = float(batch.tensors["response_lengths"].sum())
    timers["perf/step_s"] = wall
    # CPU seconds this process has used so far (every role under executor: local); the
    # difference between two steps is, on a shared machine, a steadier measure than wall time
    timers["perf/process_cpu_total_s"] = time.process_time()
    timers["perf/tokens_per_s"] = float(batch.tensors["attention_mask"].sum()) / wall
    timers["perf/generated_tokens_per_s"] = generated / max(1e-9, timers["time/rollout"])
    return {
        **rollout.metrics,
        **rl_batch_metrics(batch, cfg.rollout.max_new_tokens),
        **metrics,
        **timers,
    }
