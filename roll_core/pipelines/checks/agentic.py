"""The recipe checks of `roll train agentic`: the algorithm, the warm start, the envs (built
and reset once; agent programs loaded), image observations against the model, and the chat
template against the envs' conversations and tools. The plan runs those that need no model
(`roll validate`, `--dry-run`); `prepare` runs them again with the tokenizer loaded."""

from __future__ import annotations

from typing import Any

from roll_core.config.agentic import AgenticConfig, EnvEntry
from roll_core.envs import get_env_class, make_env
from roll_core.envs.agents import check_task, load_agent
from roll_core.envs.base import observation_images
from roll_core.envs.faults import EnvFault, call_with_timeout, describe_fault
from roll_core.envs.registry import validate_options
from roll_core.errors import ConfigError, RollError
from roll_core.models import (
    BUILTIN_PREFIX,
    chat_template_status,
    check_chat_template_choice,
    load_tokenizer,
    resolve_tokenizer_path,
    use_chat_template,
)
from roll_core.rollout.agentic import ChatFormat


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
