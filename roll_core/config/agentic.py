"""Recipe schema of `roll train agentic` (multi-turn RL in text environments)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from roll_core.config.rlvr import RLConfig, SamplingConfig, check_chunk_keys
from roll_core.config.schema import Strict


class EnvEntry(Strict):
    """One environment of the run (several may be mixed; metrics are reported per tag)."""

    env: str | None = Field(
        default=None,
        description="Registered env name (sokoban, frozen_lake, tool_use, swe), a GEM env as "
        "gem:ID (the `gem` extra, e.g. gem:game:GuessTheNumber-v0-easy), or a user env as "
        "package.module:Class. Exactly one of `env` and `agent`.",
    )
    agent: str | None = Field(
        default=None,
        description="Bring your own agent: a module with `async def run(client, task) -> "
        "float` (or a plain `def run`), named package.module:run or path/to/agent.py:run. Each "
        "episode calls run() with an openai client on its own session of the OpenAI-compatible "
        "endpoint roll serves during rollout (docs/agentic.md).",
    )
    tag: str | None = Field(
        default=None, description="Name in metrics (default: `env`, or the agent's module)."
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Env options (`roll debug-env ENV --options` lists them); for an agent, "
        "the keyword arguments of its make_task(seed, **options) (or the task's fields).",
    )
    eval_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options merged over `options` for this entry's validation episodes "
        "(e.g. `{split: test}`: held-out tasks of the swe env or a harness).",
    )
    system_prompt: str | None = Field(
        default=None,
        description="Replace the env's instructions (None: the env's own system prompt). A "
        "short prompt matters for small-context models.",
    )
    groups_per_step: int = Field(default=4, ge=1, description="Env groups of this env per step.")
    eval_episodes: int = Field(
        default=32, ge=0, description="Validation episodes (one per held-out seed)."
    )

    @model_validator(mode="after")
    def _env_or_agent(self) -> EnvEntry:
        if (self.env is None) == (self.agent is None):
            raise ValueError(
                "set exactly one of `env` (an environment roll drives turn by turn) and "
                "`agent` (your agent program, package.module:run or path/to/agent.py:run)"
            )
        return self

    @property
    def env_id(self) -> str:
        """``env`` of an env entry (an agent entry has none: a TypeError)."""
        if self.env is None:
            raise TypeError(f"envs entry {self.name} is an agent program, not an env")
        return self.env

    @property
    def name(self) -> str:
        if self.tag:
            return self.tag
        if self.agent is not None:
            target = self.agent.rsplit(":", 1)[0] if ":" in self.agent else self.agent
            return target.removesuffix(".py").replace("/", ".").rsplit(".", 1)[-1].lower()
        return str(self.env).rsplit(":", 1)[-1].lower()


class AgenticRolloutConfig(SamplingConfig):
    """Env-level async rollout: groups, redundancy, timeouts, routing, paradigm."""

    removed_keys: ClassVar[dict[str, str]] = {
        "group_size_redundancy": "removed: it kept the first group_size episodes of a group "
        "to finish, which favours short episodes (on FrozenLake a fall ends an episode at "
        "once; it collapsed one run in three). Use rollout.redundant_groups: extra whole "
        "groups per step, the first to finish kept (docs/agentic.md).",
    }

    @model_validator(mode="after")
    def _chunk_keys(self) -> AgenticRolloutConfig:
        check_chunk_keys(self, "rollout")
        return self

    mode: Literal["trajectory", "step"] = Field(
        default="trajectory",
        description="`trajectory`: one sample per episode (StarPO); `step`: one sample per turn "
        "with a bounded history window and GiGPO advantages.",
    )
    group_size: int = Field(
        default=4, ge=1, description="Episodes per env group (same seed): the group of GRPO."
    )
    redundant_groups: int = Field(
        default=0,
        ge=0,
        description="Extra groups launched per env and step beyond its groups_per_step. The "
        "step takes whole groups, the first to finish (launch order among those finished), and "
        "cancels the rest (sync) or keeps them for a later step (async_generation_ratio > 0). "
        "Every episode of a kept group ran to its end, so no group is filtered by how its "
        "episodes went: the tail of slow groups is cut without favouring short episodes.",
    )
    max_additional_groups: int = Field(
        default=0,
        ge=0,
        description="Dynamic sampling (algorithm.dynamic_sampling): extra groups per env a "
        "step may launch to replace groups whose episodes all got the same return.",
    )
    history_window: int = Field(
        default=2, ge=0, description="Step mode: earlier (observation, action) turns in a prompt."
    )
    chat_template: str = Field(
        default="model",
        description="How a conversation becomes tokens. `model`: the tokenizer's chat template. "
        "Any other value: the path of a Jinja chat-template file used instead (as "
        "`data.chat_template` of rlvr). `roll validate` checks that the template can be "
        "trained exactly in this `mode`: trajectory mode appends the template's ids for each "
        "env reply to the generated ids (token-in/token-out), which works also for templates "
        "that rewrite history (Qwen3); a template that does not write an earlier assistant "
        "turn's text as given can only run in step mode. See docs/agentic.md.",
    )
    max_new_tokens: int = Field(default=32, ge=1, description="Longest response per turn.")
    max_context: int | None = Field(
        default=None,
        ge=16,
        description="Tokens a prompt + response may take; an episode that would exceed it ends "
        "(status `context`). None: the model's max_position_embeddings.",
    )
    step_timeout_s: float = Field(
        default=30.0, gt=0, description="An env reset/step slower than this ends the episode."
    )
    episode_timeout_s: float = Field(
        default=600.0, gt=0, description="An episode longer than this (wall clock) ends."
    )
    max_replacements: int | None = Field(
        default=None,
        ge=0,
        description="Per group: episodes that raised or timed out are replaced by a fresh env "
        "instance on the same seed at most this many times. None: group_size (a run then "
        "tolerates episode fault rates up to ~30%, see docs/agentic.md).",
    )
    max_concurrent_episodes: int = Field(
        default=64, ge=1, description="Episode threads running at once."
    )
    deterministic: bool = Field(
        default=False,
        description="Fixed batch composition: generation requests go in fixed-batch calls of "
        "at most chunk_size (consecutive requests, at most max_chunks_in_flight calls per "
        "rank), the pre-streaming path; with chunk_size 1 a turn's response never depends on "
        "what else was in flight (bit-exact `roll resume`). False (streaming): each turn is "
        "its own request, sent to the rank that holds its episode's prefix (docs/rollout.md).",
    )
    chunk_size: int = Field(
        default=8,
        ge=1,
        description="Deterministic mode only: most requests per fixed-batch call (1: "
        "reproducible sampling whatever the timing).",
    )
    max_chunks_in_flight: int = Field(
        default=1, ge=1, description="Deterministic mode only: calls on one inference rank."
    )
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="A generation request not answered within this many seconds fails the "
        "step, naming the inference rank.",
    )
    endpoint_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Agent envs (`envs[].agent`): the port of the OpenAI-compatible endpoint "
        "roll serves on 127.0.0.1 during rollout (0: any free port; each episode's run() gets "
        "its base URL either way).",
    )
    agent_history: Literal["segment", "strict"] = Field(
        default="segment",
        description="Agent envs: what a call that does not continue the episode's conversation "
        "gets (one that rewrites or drops earlier messages, e.g. an agent that sends only the "
        "current state each call, or changes its tools). `segment`: it starts a new training "
        "segment of the episode, rendered by the chat template as a first call and trained as "
        "its own sequence with the episode's return (token-in/token-out within each segment). "
        "`strict`: HTTP 400 naming the first message that differs (one episode, one sequence). "
        "The run's metric rollout/segments_per_episode counts them (docs/agentic.md).",
    )
    agent_sampling: Literal["strict", "recipe"] = Field(
        default="strict",
        description="Agent envs: a call that sets sampling fields (temperature, top_p, top_k, "
        "penalties, logit_bias, seed) to values other than the recipe's. `strict`: HTTP 400 "
        "naming the field (the samples must be the policy's, sampled as the recipe says). "
        "`recipe`: the call is answered with the recipe's sampling and the reply lists the "
        "replaced fields under roll.sampling_overridden (for a harness that always sends, "
        "e.g., temperature: 0).",
    )
    agent_model_aliases: list[str] = Field(
        default_factory=list,
        description="Agent envs: model names the endpoint accepts besides model.path and "
        "`policy` (e.g. the name a harness's config insists on); any other name gets 404 "
        "model_not_found.",
    )
    turn_barrier: bool = Field(
        default=False,
        description="Lockstep baseline for comparisons: every episode waits for all others at "
        "each turn (batch rollout). Off: env-level async.",
    )
    async_generation_ratio: int = Field(
        default=0,
        ge=0,
        description="0: synchronous. k > 0: episodes keep running while training; a group is "
        "used only if its oldest turn is at most k policy versions old.",
    )


class GiGPOConfig(Strict):
    """Step-mode advantages (GiGPO, arXiv 2505.10978): A = A_episode + omega * A_step."""

    omega: float = Field(default=1.0, ge=0, description="Weight of the step-level advantage.")
    gamma: float = Field(
        default=0.95, ge=0, le=1, description="Discount of the step returns of anchor groups."
    )
    norm: Literal["group", "none"] = Field(
        default="group", description="Divide by the group's standard deviation, or not."
    )


class WarmStartConfig(Strict):
    """Optional warm-up before RL: SFT on episodes played by a scripted policy in the envs.

    ``policy: random`` (uniformly random *valid* actions) teaches the action format only, so
    what RL adds on top is the whole policy. ``policy: expert`` clones the env's own solver
    (``expert_action``: Sokoban's BFS, FrozenLake's shortest path), a demonstration warm start
    that RL then improves on. Runs once at the start of a new run (its weights are in
    checkpoints).
    """

    steps: int = Field(default=0, ge=0, description="SFT optimizer steps (0: no warm start).")
    episodes_per_step: int = Field(
        default=16, ge=1, description="Episodes per SFT step (every turn is trained)."
    )
    policy: Literal["random", "expert"] = Field(
        default="random",
        description="Who plays the warm-up episodes: random (uniformly random valid actions: "
        "the format only) or expert (the env's solver, `expert_action`; an env without one is "
        "an error; a turn where the solver has no move, e.g. a lost Sokoban room, plays a random "
        "valid action).",
    )
    lr: float | None = Field(
        default=None,
        gt=0,
        description="Learning rate of the warm-up SFT steps (null: actor_train.optim.lr), so RL "
        "can use a lower one than the format warm-up needs. Warm-up steps run outside RL's "
        "learning-rate schedule.",
    )
    eval_before: bool = Field(
        default=False,
        description="Also validate before the warm-up (logged as eval_before_warm_start/*).",
    )


class AgenticEvalConfig(Strict):
    """Validation on held-out env seeds."""

    every_steps: int | None = Field(
        default=None, ge=1, description="Validate every N steps, before training and at the end."
    )
    seed_start: int = Field(
        default=1_000_000_000,
        ge=0,
        description="Validation seeds are seed_start, seed_start+1, ...; training seeds stay "
        "below it.",
    )
    temperature: float = Field(default=0.0, ge=0, description="0: greedy decoding.")


class AgenticConfig(RLConfig):
    """`roll train agentic`: multi-turn RL in text environments (StarPO / GiGPO)."""

    pipeline: Literal["agentic"] = Field(
        default="agentic", description="Which pipeline this recipe is for."
    )
    envs: list[EnvEntry] = Field(min_length=1, description="Environments (mixed if several).")
    rollout: AgenticRolloutConfig = Field(
        default_factory=AgenticRolloutConfig, description="Rollout."
    )
    gigpo: GiGPOConfig = Field(default_factory=GiGPOConfig, description="Step-mode advantages.")
    warm_start: WarmStartConfig = Field(
        default_factory=WarmStartConfig, description="Warm-up (SFT on scripted episodes)."
    )
    eval: AgenticEvalConfig = Field(default_factory=AgenticEvalConfig, description="Validation.")

    @model_validator(mode="after")
    def _checks(self) -> AgenticConfig:
        tags = [e.name for e in self.envs]
        if len(set(tags)) != len(tags):
            raise ValueError(f"envs: tags must be distinct, got {tags}; set `tag:` per env")
        if self.algorithm.on_policy_distill is not None:
            raise ValueError(
                "algorithm.on_policy_distill runs in `roll train rlvr` only (its teachers score "
                "single-turn responses to dataset prompts); remove the section"
            )
        if self.rollout.turn_barrier and self.rollout.async_generation_ratio:
            raise ValueError(
                "rollout.turn_barrier (the lockstep baseline) cannot run with "
                "rollout.async_generation_ratio > 0; use one or the other"
            )
        if self.rollout.mode == "trajectory":
            rows = self.rollout.group_size * sum(e.groups_per_step for e in self.envs)
            if rows % self.trainer.mini_batches:
                raise ValueError(
                    f"trainer.mini_batches={self.trainer.mini_batches} must divide the episodes "
                    f"per step (rollout.group_size x sum of groups_per_step = {rows})"
                )
        return self
