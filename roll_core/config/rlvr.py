"""Recipe schema of `roll train rlvr` (RL with verifiable rewards)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from roll_core.config.algorithm import AlgorithmConfig
from roll_core.config.reward import RewardConfig
from roll_core.config.schema import (
    ActorTrainConfig,
    CheckpointConfig,
    DatasetSource,
    ExecutorConfig,
    ModelConfig,
    Strict,
    TrackingConfig,
)


class RLDataConfig(Strict):
    """Prompts with reference answers; each row's `domain` picks its reward."""

    train: DatasetSource = Field(description="Training prompts.")
    eval: DatasetSource | None = Field(default=None, description="Held-out prompts for validation.")
    prompt_key: str = Field(default="prompt", description="Column holding the prompt text.")
    answer_key: str = Field(default="answer", description="Column holding the reference answer.")
    system_prompt: str | None = Field(
        default=None, description="Optional system message before every prompt."
    )
    max_prompt_length: int = Field(
        default=512,
        ge=1,
        description="Prompts longer than this (in tokens) are dropped and counted.",
    )
    shuffle: bool = Field(
        default=True, description="Shuffle prompts every epoch (seeded by `seed`)."
    )


class RolloutConfig(Strict):
    """Sample-level rollout: replication, routing, sampling, dynamic sampling."""

    n: int = Field(default=8, ge=1, description="Samples per prompt (the group size).")
    prompts_per_step: int = Field(default=16, ge=1, description="Groups kept per training step.")
    max_new_tokens: int = Field(default=256, ge=1, description="Longest response in tokens.")
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0: off).")
    stop: list[str] = Field(
        default_factory=list, description="Stop strings (the eos token always stops)."
    )
    chunk_size: int = Field(
        default=16,
        ge=1,
        description="Requests sent to an inference rank per call (1 = per sample).",
    )
    max_chunks_in_flight: int = Field(
        default=2, ge=1, description="Chunks queued on one inference rank at a time."
    )
    max_additional_prompts: int = Field(
        default=0,
        ge=0,
        description="Dynamic sampling: extra prompts a step may pull to replace dropped groups.",
    )
    reward_workers: int = Field(
        default=4, ge=1, description="Threads scoring responses as they arrive."
    )


class RLTrainerConfig(Strict):
    """The driver loop of RL."""

    max_steps: int = Field(ge=1, description="Rollout + update iterations.")
    micro_batch_size: int = Field(default=8, ge=1, description="Rows per forward/backward pass.")
    ppo_epochs: int = Field(default=1, ge=1, description="Passes over each rollout batch.")
    mini_batches: int = Field(
        default=1,
        ge=1,
        description="Optimizer steps per epoch (the batch is split into this many).",
    )
    log_every_steps: int = Field(default=1, ge=1, description="Log metrics every N steps.")


class ActorInferConfig(Strict):
    """The role that generates rollouts."""

    backend: Literal["hf"] = Field(default="hf", description="`hf`: transformers generate.")
    world_size: int = Field(default=1, ge=1, description="Inference ranks (data parallel).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Device of each rank."
    )
    num_threads: int | None = Field(default=None, ge=1, description="torch CPU threads per rank.")


class RLEvalConfig(Strict):
    """Validation: greedy (or sampled) answers on `data.eval`, scored by the rewards."""

    every_steps: int | None = Field(
        default=None, ge=1, description="Validate every N steps, before training and at the end."
    )
    max_samples: int | None = Field(default=None, ge=1, description="Validate on at most N rows.")
    temperature: float = Field(default=0.0, ge=0, description="0: greedy decoding.")
    max_new_tokens: int | None = Field(
        default=None, ge=1, description="None: rollout.max_new_tokens."
    )


class RLVRConfig(Strict):
    """`roll train rlvr`: RL with verifiable rewards (GRPO, DAPO, PPO-family presets)."""

    pipeline: Literal["rlvr"] = Field(
        default="rlvr", description="Which pipeline this recipe is for."
    )
    name: str = Field(default="rlvr", description="Human name of the experiment.")
    seed: int = Field(default=0, description="Seed for shuffling and sampling.")
    runs_dir: str = Field(default="runs", description="Parent directory of run directories.")
    model: ModelConfig = Field(description="The initial policy (and the reference).")
    data: RLDataConfig = Field(description="Prompts and answers.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="RL algorithm.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Rewards per domain.")
    trainer: RLTrainerConfig = Field(description="Driver loop.")
    actor_train: ActorTrainConfig = Field(
        default_factory=ActorTrainConfig, description="Training role."
    )
    actor_infer: ActorInferConfig = Field(
        default_factory=ActorInferConfig, description="Inference role."
    )
    eval: RLEvalConfig = Field(default_factory=RLEvalConfig, description="Validation.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints."
    )
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig, description="Executor.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="Trackers.")

    @model_validator(mode="after")
    def _checks(self) -> RLVRConfig:
        if self.eval.every_steps is not None and self.data.eval is None:
            raise ValueError("eval.every_steps is set but data.eval is not: add data.eval.path")
        rows = self.rollout.n * self.rollout.prompts_per_step
        if rows % self.trainer.mini_batches:
            raise ValueError(
                f"trainer.mini_batches={self.trainer.mini_batches} must divide the rollout batch "
                f"(rollout.n x rollout.prompts_per_step = {rows})"
            )
        return self
