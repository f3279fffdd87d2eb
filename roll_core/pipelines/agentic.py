"""`roll train agentic`: multi-turn RL in text environments.

What is agentic's own: the envs and their checks, the rollout source (the env rollout
manager, rollout/agentic/: env-level async episodes, G per group), the batch layout
(StarPO: one row per episode; GiGPO, `rollout.mode: step`: one row per turn, with GiGPO's
advantages), the optional warm start (SFT on scripted episodes) and validation on held-out
env seeds. The loop itself is pipelines/rl_loop.py, shared with `roll train rlvr`::

    warm_start()                                   # optional: SFT on scripted episodes
    for step in run.steps(max_steps):
        groups  = rollout.next_batch(step)         # env-level async episodes, G per group
        batch   = trajectory_batch(groups)         # StarPO: one row per episode
                  or step_batch(groups)            # GiGPO: one row per turn
        batch  += reference / old log-probs        # only what the algorithm needs
        batch  += advantages                       # GRPO-family on episode returns, or GiGPO
        metrics = actor_train.train_step(batch, "rl")
        suspend rollout -> sync_weights -> resume  # policy version = step
                                                   # colocated: turn moves, pipelines/turns.py
        if validation due: metrics |= validate()   # held-out env seeds, greedy
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from roll_core.algorithms import clip_advantages
from roll_core.algorithms.gigpo import gigpo_advantages
from roll_core.backends.infer import Completion, SamplingParams
from roll_core.config.agentic import AgenticConfig, EnvEntry
from roll_core.data import Batch
from roll_core.data.vision import VISION_FIELDS
from roll_core.engine import Cluster
from roll_core.engine.plan import Plan
from roll_core.envs import get_env_class, make_env
from roll_core.envs.agents import check_task, load_agent
from roll_core.envs.base import observation_images
from roll_core.envs.faults import EnvFault, EnvTimeout, call_with_timeout, describe_fault
from roll_core.envs.registry import validate_options
from roll_core.errors import ConfigError, RollError
from roll_core.models import (
    BUILTIN_PREFIX,
    chat_template_status,
    check_chat_template_choice,
    load_tokenizer,
    resolve_model_path,
    resolve_tokenizer_path,
    use_chat_template,
)
from roll_core.models.loading import is_vision_model
from roll_core.models.vision import load_processor
from roll_core.pipelines import roles
from roll_core.pipelines.common import DriverLoop, RolePlan
from roll_core.pipelines.rl_iteration import RLState, sampling_params
from roll_core.pipelines.rl_loop import RLHooks, logging_faults, run_rl
from roll_core.rollout.agentic import (
    ChatFormat,
    EnvRolloutManager,
    EnvSpec,
    RolloutSettings,
    Trajectory,
    episode_metrics,
    play_episode,
    step_batch,
    trajectory_batch,
)
from roll_core.rollout.agentic.agent_episode import (
    expert_responder,
    openai_client,
    play_scripted,
)
from roll_core.rollout.agentic.endpoint import AgentEndpoint, check_port
from roll_core.rollout.router import rollout_mode
from roll_core.rollout.source import AgenticSource

DEMO_SEED_START = 2_000_000_000  # warm-start demonstrations: neither training nor eval seeds
WARM_START_WHAT = {"random": "random valid actions", "expert": "the env's expert actions"}


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
    rows.append(
        RolePlan(
            "envs",
            "EnvRolloutManager",
            "threads",
            min(
                r.max_concurrent_episodes,
                episodes + r.redundant_groups * len(cfg.envs) * r.group_size,
            ),
            "cpu",
            "driver",
            f"{envs}; group size {r.group_size}; {r.redundant_groups} redundant groups/env",
        )
    )
    return rows


def check_algorithm(cfg: AgenticConfig) -> None:
    """Algorithm choices this pipeline cannot run, as recipe errors (no model is loaded)."""
    algo = cfg.algorithm
    if algo.uses_critic:
        raise ConfigError(
            "algorithm.adv_estimator=gae needs a critic, and `roll train agentic` does not "
            "build a critic role.",
            hint="Use grpo, dr_grpo, rloo or reinforce_plus_plus (rollout.mode: trajectory), "
            "or rollout.mode: step (GiGPO).",
        )
    if algo.needs_groups and cfg.rollout.group_size < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={algo.adv_estimator} compares the episodes of a group, "
            f"but rollout.group_size is {cfg.rollout.group_size}.",
            hint="Set rollout.group_size to 2 or more (4-8 is common).",
        )
    if cfg.rollout.mode == "step":
        if cfg.rollout.group_size < 2:
            raise ConfigError(
                "rollout.mode=step (GiGPO) compares the episodes of a group, but "
                f"rollout.group_size is {cfg.rollout.group_size}.",
                hint="Set rollout.group_size to 2 or more.",
            )
        if algo.kl.coef > 0 and algo.kl.use_as == "reward":
            raise ConfigError(
                "rollout.mode=step computes GiGPO advantages from env rewards; a KL penalty "
                "in the reward (algorithm.kl.use_as: reward) is not supported there.",
                hint="Use algorithm.kl.use_as: loss, or algorithm.kl.coef: 0.",
            )


@dataclass
class AgenticSetup:
    model_path: str
    tokenizer_path: str
    tokenizer: Any
    max_context: int
    processor: Any = None  # a vision-language model's VisionProcessor (image observations)
    chat: ChatFormat | None = None  # the checked chat format (template policy for the log)


def check_warm_start(cfg: AgenticConfig) -> None:
    """``warm_start.policy: expert`` needs every env to have a solver (``expert_action``)."""
    if not cfg.warm_start.steps:
        return
    agents = [e.name for e in cfg.envs if e.agent is not None]
    if agents and cfg.warm_start.policy != "expert":
        raise ConfigError(
            f"warm_start.policy: {cfg.warm_start.policy} plays random valid actions, but envs "
            f"{agents} are agent programs, which have no action set to draw from.",
            hint="Use warm_start.policy: expert (the agent module's expert(task, messages)), "
            "or warm_start.steps: 0.",
        )
    if cfg.warm_start.policy != "expert":
        return
    for i, entry in enumerate(cfg.envs):
        if entry.agent is not None:
            if load_agent(entry.agent).expert is None:
                raise ConfigError(
                    f"warm_start.policy: expert clones each env's solver, but envs[{i}] "
                    f"({entry.name}, agent {entry.agent}) has no expert(task, messages) "
                    "function.",
                    hint="Define expert(task, messages) in the agent module (what a good "
                    "model answers to a call; docs/agentic.md), or set warm_start.steps: 0.",
                )
            continue
        if not get_env_class(entry.env_id).has_expert():
            raise ConfigError(
                f"warm_start.policy: expert clones each env's solver, but envs[{i}] "
                f"({entry.name}, env {entry.env}) has none (its class does not define "
                "expert_action()).",
                hint="Use warm_start.policy: random (the action format only), or give the env "
                "an expert_action() method returning a good action for the current state.",
            )


def check_images(cfg: AgenticConfig) -> None:
    """An env that shows pictures (``obs_mode: image``) needs a vision-language model: a
    recipe error naming both when the model is known to be text-only (no model is loaded; a
    hub model not in the local cache is checked when it is loaded)."""
    from roll_core.models.loading import model_config

    for i, entry in enumerate(cfg.envs):
        if entry.agent is not None:
            continue
        options = validate_options(get_env_class(entry.env_id), dict(entry.options))
        if getattr(options, "obs_mode", "text") != "image":
            continue
        config = model_config(cfg.model.path)
        if config and "vision_config" not in config:
            raise ConfigError(
                f"envs[{i}] ({entry.name}) sets options.obs_mode=image, so its observations "
                f"are pictures, but model.path={cfg.model.path} is a text-only model (its "
                "config has no vision tower): it cannot see them.",
                hint="Use a vision-language model (builtin:tiny-qwen2.5-vl on CPU, "
                "Qwen/Qwen2.5-VL-3B-Instruct / 7B on GPU), or obs_mode: text for a text model.",
            )


def check_env(entry: EnvEntry, timeout: float) -> bool:
    """Build and reset each env once, so a bad name or option fails before a run exists;
    returns whether its observations carry images. An agent: its module loads, its options fit
    its make_task, and it makes the task of seed 0 (roll_core/envs/agents.py). With
    ``eval_options`` and validation episodes: the validation episodes' env (task) is made
    too."""
    merged = {**entry.options, **entry.eval_options}
    validated = bool(entry.eval_options and entry.eval_episodes)
    if entry.agent is not None:
        check_task(load_agent(entry.agent, entry.options), 0, timeout)
        if validated:
            check_task(load_agent(entry.agent, merged), 0, timeout)
        return False
    get_env_class(entry.env_id)
    if validated:
        make_env(entry.env_id, **merged)  # bad validation options fail before the run too
    env = make_env(entry.env_id, **entry.options)
    try:
        observation, _ = call_with_timeout(env.reset, 0, timeout=timeout)
        return bool(observation_images(observation))
    except RollError:
        raise  # already a user-facing error (e.g. options that cannot make a room)
    except Exception as err:  # noqa: BLE001 - the user's env raised or hung
        raise EnvFault(
            f"env {entry.name}: reset(seed=0) failed before training started: "
            f"{describe_fault(err)}",
            hint=f"Run `roll debug-env {entry.env}` to reproduce it; raise "
            "rollout.step_timeout_s if the reset is slow rather than hung.",
        ) from None


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


def check_chat_format(cfg: AgenticConfig, tokenizer: Any = None) -> ChatFormat | None:
    """Whether the chat template (the tokenizer's, or ``rollout.chat_template``) can be trained
    exactly in ``rollout.mode`` for the envs' conversations, before a run directory exists: a
    ConfigError if not. Envs with native tools (``TextEnv.tools``) get their schemas checked,
    and the template must render them and tool results. Without ``tokenizer`` (``roll
    validate``, dry run) the tokenizer is loaded when its files are on this machine (a built-in
    model's ChatML template is known to be fine without tools; a hub id not in the cache is
    checked when the run loads it). Returns the ChatFormat it checked, with its
    ``shape_checks`` (None: not checked)."""
    r = cfg.rollout
    name = cfg.model.tokenizer or cfg.model.path
    check_chat_template_choice(r.chat_template, key="rollout.chat_template", tokenizer_name=name)
    tools = env_tools(cfg)
    if tokenizer is None:
        if name.startswith(BUILTIN_PREFIX) and r.chat_template == "model" and not tools:
            return None
        try:
            if not name.startswith(BUILTIN_PREFIX) and chat_template_status(name) is None:
                return None
        except RollError:
            return None  # a missing model is reported by its own check
        tokenizer = load_tokenizer(resolve_tokenizer_path(name))
        use_chat_template(tokenizer, r.chat_template)
    chat = ChatFormat(tokenizer)
    source = (
        f"the chat template {r.chat_template}"
        if r.chat_template != "model"
        else f"the chat template of {name}"
    )
    if r.mode == "trajectory" and not chat.can_append:
        raise ConfigError(
            f"rollout.mode=trajectory appends each env reply to the ids the model generated, "
            f"but {source} cannot continue a conversation that way: {chat.append_error}.",
            hint="Use rollout.mode: step (each turn is its own sample; history_window earlier "
            "turns are rendered into its prompt), or set rollout.chat_template to a template "
            "file that writes earlier assistant turns verbatim.",
        )
    if r.mode == "step" and r.history_window and not chat.renders_history:
        raise ConfigError(
            f"rollout.history_window={r.history_window} renders earlier turns into each "
            f"prompt, but {source}: {chat.append_error}.",
            hint="Set rollout.history_window: 0, or rollout.chat_template to a template "
            "file that renders multi-turn conversations.",
        )
    _check_tool_template(chat, tools, source, r.mode)
    if chat.renders_history:
        chat.check_shapes(next((schemas for _, _, schemas in tools), None))
    return chat


def env_tools(cfg: AgenticConfig) -> list[tuple[int, EnvEntry, list[dict[str, Any]]]]:
    """``(index, entry, tool schemas)`` of every env that declares native tools, each schema
    checked (OpenAI function format, valid JSON Schema): a ConfigError naming the env and the
    tool otherwise. Builds each env once (no reset)."""
    from roll_core.envs.tools import SCHEMA_VALIDATOR, schema_problems

    found = []
    for i, entry in enumerate(cfg.envs):
        if entry.agent is not None:
            continue  # an agent declares its tools per call (checked by the endpoint)
        schemas = list(make_env(entry.env_id, **entry.options).tools)
        for schema in schemas:
            problems = schema_problems(schema)
            if problems:
                raise ConfigError(
                    f"envs[{i}] ({entry.name}, env {entry.env}) declares a tool whose schema is "
                    f"not valid: {'; '.join(problems)} (checked with {SCHEMA_VALIDATOR}).",
                    hint="A tool is {'type': 'function', 'function': {'name', 'description', "
                    "'parameters': a JSON Schema object}} (the OpenAI function format); fix the "
                    "env's `tools`.",
                )
        if schemas:
            found.append((i, entry, schemas))
    return found


def _check_tool_template(
    chat: ChatFormat,
    tools: list[tuple[int, EnvEntry, list[dict[str, Any]]]],
    source: str,
    mode: str,
) -> None:
    """The template must show the model the envs' tools, and (trajectory mode) write tool
    results after the generated ids."""
    from roll_core.data.chat import tool_support_problem
    from roll_core.envs.base import ToolResult

    for i, entry, schemas in tools:
        names = ", ".join(str(t["function"]["name"]) for t in schemas)
        problem = tool_support_problem(chat.tokenizer, schemas)
        if problem:
            raise ConfigError(
                f"envs[{i}] ({entry.name}) declares tools ({names}), but {source} has no tool "
                f"support: {problem}, so the model would never see them.",
                hint="Set rollout.chat_template to a template file that renders `tools` (e.g. "
                "the chat_template of Qwen2.5-Instruct or Qwen3), or use a model whose "
                "template does.",
            )
        if mode == "trajectory":
            try:
                chat.tool_reply_text([ToolResult(names.split(",")[0], "ROLL_TOOL_PROBE")])
            except RollError as err:
                raise ConfigError(
                    f"envs[{i}] ({entry.name}) sends tool results, but {source} cannot append "
                    f"them to the generated ids: {err.message}",
                    hint=err.hint or "Use rollout.mode: step.",
                ) from None


def template_policy(chat: ChatFormat, mode: str) -> str | None:
    """One line for the run's log on how the chat template is used (None: nothing to say):
    which conversation shapes it rewrites (:meth:`ChatFormat.check_shapes`) and the policy,
    which is the same for all of them: the trace is never re-rendered."""
    if mode == "step":
        return None
    rewritten = [c.shape for c in chat.shape_checks if not c.stable]
    if chat.prefix_stable and not rewritten:
        return None
    which = f" ({'; '.join(rewritten)})" if rewritten else " (e.g. Qwen3 drops their reasoning)"
    return (
        f"chat template: it rewrites earlier turns{which}, so trajectories are never "
        "re-rendered: each turn's prompt is the ids the model was given before plus what it "
        "generated plus the template's ids for the env's reply or tool results "
        "(token-in/token-out), and exactly those ids are trained."
    )


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
    cfg: AgenticConfig, manager: EnvRolloutManager, specs: list[EnvSpec]
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
        trajs += manager.run_episodes(spec, seeds, params)
    metrics = episode_metrics(trajs, prefix="eval")  # a failed episode counts as a failure
    metrics["eval/env_errors"] = float(sum(t.status == "error" for t in trajs))
    metrics["eval/env_timeouts"] = float(sum(t.status == "timeout" for t in trajs))
    metrics["eval/wall_s"] = time.perf_counter() - start
    return metrics


# ---- warm start -------------------------------------------------------------------------------
def demonstrations(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    specs: list[EnvSpec],
    *,
    count: int,
    offset: int,
    faults: dict[str, float] | None = None,
) -> list[Trajectory]:
    """`count` episodes per env played by the warm start's policy (``warm_start.policy``:
    uniformly random *valid* actions, or the env's ``expert_action``), in the rollout's prompt
    format; each response is the action text + eos.

    Env calls run under ``rollout.step_timeout_s`` as in training; an episode whose env raises
    or hangs is counted in `faults` (``warm_start/env_errors`` / ``env_timeouts``) and replaced
    by another seed; :class:`EnvFault` once more than ``count`` + (episodes completed) have
    failed, i.e. when more than half of an env's episodes fail.
    """
    chat = ChatFormat(setup.tokenizer, setup.processor)
    # agent programs call an endpoint answered by their expert(): one for these episodes
    endpoint = (
        AgentEndpoint(port=0, model=cfg.model.path, aliases=tuple(cfg.rollout.agent_model_aliases))
        if any(x.agent for x in specs)
        else None
    )
    try:
        return _demonstrations(cfg, setup, specs, chat, endpoint, count, offset, faults)
    finally:
        if endpoint is not None:
            endpoint.close()


def _demonstrations(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    specs: list[EnvSpec],
    chat: ChatFormat,
    endpoint: AgentEndpoint | None,
    count: int,
    offset: int,
    faults: dict[str, float] | None,
) -> list[Trajectory]:
    s = settings(cfg, setup)
    faults = {} if faults is None else faults
    out = []
    for spec in specs:
        if spec.agent is not None:
            assert endpoint is not None
            out += _agent_demos(cfg, setup, spec, chat, endpoint, count, offset, faults)
            continue
        failed: list[str] = []
        slot = 0
        while slot < count:
            # a replaced episode plays another seed, outside every slot's first seed
            seed = DEMO_SEED_START + 1_000_000 * len(failed) + offset + slot
            actor = _ScriptedActor(spec, chat, seed, s.step_timeout_s, cfg.warm_start.policy)
            traj = Trajectory(tag=spec.tag, group=slot, seed=seed, index=0)
            try:
                out.append(
                    play_episode(
                        traj,
                        spec,
                        chat=chat,
                        settings=s,
                        max_new_tokens=cfg.rollout.max_new_tokens,
                        generate=actor.generate,
                        env_call=actor.env_call,
                    )
                )
                slot += 1
            except Exception as err:  # noqa: BLE001 - the env raised or hung: count, replace
                _demo_failed(cfg, spec, err, failed, slot, count, faults)
    return out


def _demo_failed(
    cfg: AgenticConfig,
    spec: EnvSpec,
    err: Exception,
    failed: list[str],
    completed: int,
    count: int,
    faults: dict[str, float],
) -> None:
    """Count a failed warm-start episode; EnvFault once more than half of them failed."""
    kind = "env_timeouts" if isinstance(err, EnvTimeout) else "env_errors"
    faults[f"warm_start/{kind}"] = faults.get(f"warm_start/{kind}", 0.0) + 1
    failed.append(describe_fault(err))
    if len(failed) > count + completed:  # more than half of the episodes failed
        raise EnvFault(
            f"warm start: env {spec.tag} failed {len(failed)} "
            f"{cfg.warm_start.policy}-policy episodes while {completed} completed (step timeout "
            f"rollout.step_timeout_s={cfg.rollout.step_timeout_s:g}s). First error: "
            f"{failed[0]}",
            hint="Fix the env (`roll debug-env ENV --policy random` shows the "
            "error), raise rollout.step_timeout_s if its steps are slow, or set "
            "warm_start.steps: 0.",
            metrics=faults,
        ) from None


def _agent_demos(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    spec: EnvSpec,
    chat: ChatFormat,
    endpoint: AgentEndpoint,
    count: int,
    offset: int,
    faults: dict[str, float],
) -> list[Trajectory]:
    """``count`` expert episodes of an agent program, played at once (up to
    ``rollout.max_concurrent_episodes``: an agent's own start-up and tool time overlap); a
    failed one is replayed on another seed in the next round, as env demonstrations are."""
    from concurrent.futures import ThreadPoolExecutor

    done: dict[int, Trajectory] = {}
    failed: list[str] = []
    pending = list(range(count))
    workers = max(1, min(count, cfg.rollout.max_concurrent_episodes))
    with ThreadPoolExecutor(workers, thread_name_prefix="warm-start-agent") as pool:
        for round_ in range(count + 1):
            if not pending:
                break

            def play(slot: int, round_: int = round_) -> Trajectory:
                seed = DEMO_SEED_START + 1_000_000 * round_ + offset + slot
                traj = Trajectory(tag=spec.tag, group=slot, seed=seed, index=0)
                timeout = cfg.rollout.episode_timeout_s
                return _agent_demo(cfg, setup, spec, traj, chat, endpoint, timeout)

            futures = {slot: pool.submit(play, slot) for slot in pending}
            pending = []
            for slot, future in futures.items():
                try:
                    done[slot] = future.result()
                except Exception as err:  # noqa: BLE001 - the agent failed: count, replay
                    pending.append(slot)
                    _demo_failed(cfg, spec, err, failed, len(done), count, faults)
    return [done[k] for k in range(count)]


def _agent_demo(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    spec: EnvSpec,
    traj: Trajectory,
    chat: ChatFormat,
    endpoint: AgentEndpoint,
    timeout: float,
) -> Trajectory:
    """A warm-start episode of an agent program, its calls answered by its expert()."""
    assert spec.agent is not None
    return play_scripted(
        traj,
        spec.agent,
        expert_responder(spec.agent, chat),
        endpoint=endpoint,
        chat=chat,
        max_new_tokens=cfg.rollout.max_new_tokens,
        max_context=setup.max_context,
        timeout=timeout,
        history=cfg.rollout.agent_history,
    )


class _ScriptedActor:
    """Plays a uniformly random valid action (policy ``random``) or the env's expert action
    (``expert``; a random valid one where the expert has none) each turn; the response is the
    action's text + eos."""

    def __init__(
        self, spec: EnvSpec, chat: ChatFormat, seed: int, timeout: float, policy: str = "random"
    ) -> None:
        self.spec, self.chat, self.seed, self.timeout = spec, chat, seed, timeout
        self.policy = policy
        self.rng = np.random.default_rng(seed)
        self.env: Any = None

    def env_call(self, fn: Any, *args: Any) -> Any:
        result = call_with_timeout(fn, *args, timeout=self.timeout)
        if fn is self.spec.factory:
            self.env = result
        return result

    def generate(self, prompt: list[int], turn: int, vision: Any = None) -> Completion:
        eos = [self.chat.eos_id] if self.chat.eos_id is not None else []
        action = None
        if self.policy == "expert":
            action = call_with_timeout(self.env.expert_action, timeout=self.timeout)
        if action is None:
            action = call_with_timeout(self.env.random_action, self.rng, timeout=self.timeout)
        ids = self.chat.encode(action) + eos
        return Completion(0, ids, [0.0] * len(ids), "stop", -1)


def warm_start(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    actor: Cluster,
    specs: list[EnvSpec],
    advance: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """SFT on the warm start policy's episodes (random valid actions: the format; the env's
    expert: a demonstration warm start); returns its metrics.
    ``advance`` is called after each step (progress)."""
    w = cfg.warm_start
    losses = []
    faults: dict[str, float] = {"warm_start/env_errors": 0.0, "warm_start/env_timeouts": 0.0}
    per_env = max(1, w.episodes_per_step // len(specs))
    for k in range(w.steps):
        demos = demonstrations(cfg, setup, specs, count=per_env, offset=k * per_env, faults=faults)
        build = step_batch if cfg.rollout.mode == "step" else trajectory_batch
        batch = build(
            [[t] for t in demos], pad_id=setup.tokenizer.pad_token_id, max_len=setup.max_context
        )
        resp = batch.tensors["response_mask"]
        batch = Batch(
            tensors={
                "input_ids": batch.tensors["input_ids"],
                "attention_mask": batch.tensors["attention_mask"],
                "loss_mask": torch.cat([torch.zeros_like(resp[:, :1]), resp], dim=1).long(),
            },
            non_tensors={k: batch.non_tensors[k] for k in VISION_FIELDS if k in batch},
            meta={"loss_tokens": int(resp.sum())},
        )
        out = actor.train_step(batch, lr=w.lr or cfg.actor_train.optim.lr)  # outside the schedule
        losses.append(out["train/loss_sum"] / max(1, int(resp.sum())))
        advance()
    return {
        "warm_start/steps": float(w.steps),
        "warm_start/loss_last": losses[-1],
        "warm_start/lr": out["train/lr"],
        **faults,
    }


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
                return validate(cfg, source.manager, eval_specs)
            finally:
                source.show_faults()

        def warm(start: int) -> None:
            if start == 0 and cfg.warm_start.steps:
                _warm_start_phase(cfg, setup, rl, source.manager, specs, loop, evaluate, eval_specs)

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
    """The env rollout manager on actor_infer, as the loop's rollout source (``note``: where
    the first faults of each env are shown)."""
    manager = EnvRolloutManager(
        infer=rl.actor_infer,
        tokenizer=setup.tokenizer,
        specs=specs,
        settings=settings(cfg, setup),
        processor=setup.processor,
    )
    pad = setup.tokenizer.pad_token_id
    return AgenticSource(
        manager, pad_id=pad, mode=cfg.rollout.mode, gamma=cfg.gigpo.gamma, note=note
    )


def _warm_start_phase(
    cfg: AgenticConfig,
    setup: AgenticSetup,
    rl: roles.RLRoles,
    manager: EnvRolloutManager,
    specs: list[EnvSpec],
    loop: DriverLoop,
    evaluate: bool,
    eval_specs: list[EnvSpec],
) -> None:
    """The warm start before step 1 (validation before it if asked), logged at step 0."""
    if evaluate and cfg.warm_start.eval_before:
        with loop.phase("evaluating"):
            before = validate(cfg, manager, eval_specs)
        loop.log_extra(
            0, {k.replace("eval/", "eval_before_warm_start/"): v for k, v in before.items()}
        )
    t = time.perf_counter()
    what = WARM_START_WHAT[cfg.warm_start.policy]
    with loop.phase(f"warm start (SFT on {what})", cfg.warm_start.steps) as p:
        metrics = logging_faults(
            loop, 0, lambda: warm_start(cfg, setup, rl.actor_train, specs, advance=p.advance)
        )
    metrics["warm_start/seconds"] = time.perf_counter() - t
    loop.console_note(
        f"warm start: {cfg.warm_start.steps} SFT steps on {what}, "
        f"loss {metrics['warm_start/loss_last']:.3f}"
    )
    loop.log_extra(0, metrics)


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
