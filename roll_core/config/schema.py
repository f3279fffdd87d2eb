"""Typed recipe schema.

A recipe is YAML; it becomes one of these objects at the CLI edge and raw dicts never travel
deeper. Every model forbids unknown keys (a typo is an error, never silently ignored) and every
field carries a description: `docs/config.md` is generated from them (`roll schema`)
and a test keeps the two in sync.

Components are nested the same way in every pipeline: ``model``, ``data``, ``trainer``,
``actor_train`` (the role that trains), ``eval``, ``checkpoint``, ``executor``, ``tracking``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """Base for every recipe section: unknown keys are errors; defaults are validated too."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelConfig(Strict):
    """Which model and tokenizer to start from."""

    path: str = Field(
        description="`builtin:NAME` (see `roll models`), a local Hugging Face model directory, "
        "or a Hugging Face hub id such as `Qwen/Qwen3-8B` (downloaded when online)."
    )
    tokenizer: str | None = Field(
        default=None, description="Tokenizer location when it differs from `model.path`."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="Dtype of the trained parameters. Keep float32 with mixed precision "
        "(`actor_train.precision: bf16`); lower it only to save memory.",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass to save memory."
    )


class DatasetSource(Strict):
    """One dataset: a local json/jsonl/parquet/csv file or directory, or a hub dataset name."""

    path: str = Field(description="Local file or directory, or a hub dataset name.")
    split: str = Field(default="train", description="Split to read.")
    subset: str | None = Field(
        default=None,
        description="Hub dataset configuration name (of a local hub snapshot: its subfolder).",
    )
    max_rows: int | None = Field(
        default=None, ge=1, description="Read at most this many rows (None: all)."
    )


class SFTDataConfig(Strict):
    """Supervised data: prompt/response pairs or chat messages; loss on response tokens only."""

    train: DatasetSource = Field(description="Training data.")
    eval: DatasetSource | None = Field(default=None, description="Held-out data for `eval`.")
    format: Literal["prompt_response", "messages"] = Field(
        default="prompt_response",
        description="`prompt_response`: one user prompt and one answer per row; `messages`: a "
        "list of {role, content} chat messages (every assistant turn is trained).",
    )
    prompt_key: str = Field(default="prompt", description="Column holding the prompt.")
    response_key: str = Field(default="response", description="Column holding the response.")
    messages_key: str = Field(default="messages", description="Column holding chat messages.")
    image_key: str = Field(
        default="images",
        description="Column holding each row's image(s) for a vision-language model: a path "
        "(relative to the data file), bytes, a datasets.Image value, or a list of them. Rows "
        "with an unreadable image are skipped and counted; a text-only model given a dataset "
        "with images in this column is an error. No such column: text rows. See docs/vlm.md.",
    )
    max_length: int = Field(
        default=1024,
        ge=8,
        description="Longest tokenised example (prompt + response). Longer rows are dropped "
        "and counted, never silently truncated.",
    )
    shuffle: bool = Field(default=True, description="Shuffle every epoch (seeded by `seed`).")


class OptimConfig(Strict):
    """AdamW with warmup and a decaying learning rate."""

    lr: float = Field(default=1e-5, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW betas.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        default=1.0, gt=0, description="Clip the global gradient norm to this (None: no clip)."
    )
    scheduler: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="Decay after warmup."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup steps from 0.")
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1, description="Final learning rate as a fraction of `lr`."
    )
    fused: bool = Field(
        default=False,
        description="torch's fused AdamW kernel (CPU and CUDA): a faster optimizer step, equal "
        "to the default (multi-tensor) one up to the last bits. Not with deepspeed's "
        "offload_optimizer (DeepSpeed's CPU Adam).",
    )


class LoraConfig(Strict):
    """LoRA adapters (via `peft`): train small low-rank matrices, keep the base weights frozen."""

    rank: int = Field(
        default=8, ge=1, description="Rank r of each adapter's A (r x in) and B (out x r)."
    )
    alpha: float = Field(
        default=16.0, gt=0, description="Scale: an adapter adds (alpha / rank) * B @ A."
    )
    dropout: float = Field(
        default=0.0, ge=0, lt=1, description="Dropout on the adapter's input (0: none)."
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Linear modules that get adapters: names or name suffixes (`q_proj`, "
        "`mlp.down_proj`), or `all-linear` (every linear layer but the output head). A name "
        "that matches no linear layer is an error that lists the model's linear layers.",
    )


class FSDP2Config(Strict):
    """Options of the `fsdp2` train backend (torch.distributed.fsdp.fully_shard)."""

    cpu_offload: bool = Field(
        default=False,
        description="Keep sharded parameters, gradients and optimizer state in CPU memory "
        "(CPUOffloadPolicy); GPU memory then holds one layer's weights at a time.",
    )
    reshard_after_forward: bool = Field(
        default=True,
        description="Free gathered parameters after each layer's forward (ZeRO-3 like); "
        "False keeps them until backward (ZeRO-2 like, more memory, less communication).",
    )


class DeepSpeedConfig(Strict):
    """Options of the `deepspeed` train backend (ZeRO)."""

    zero_stage: Literal[1, 2, 3] = Field(
        default=2,
        description="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.",
    )
    offload_optimizer: bool = Field(
        default=False, description="Optimizer state (and its step) in CPU memory (ZeRO-Offload)."
    )
    offload_param: bool = Field(
        default=False, description="Parameters in CPU memory (ZeRO-Infinity; needs zero_stage 3)."
    )

    @model_validator(mode="after")
    def _offload_needs_stage3(self) -> DeepSpeedConfig:
        if self.offload_param and self.zero_stage != 3:
            raise ValueError(
                f"deepspeed.offload_param needs zero_stage 3 (got {self.zero_stage}): only "
                "ZeRO-3 shards parameters. Set zero_stage: 3 or offload_param: false"
            )
        return self


class MegatronConfig(Strict):
    """The parallel layout of the `megatron` train backend (megatron-core). The ranks of
    actor_train (`world_size`) are split into tp x pp x ep x data parallel: `world_size` must be
    a multiple of tp * pp * ep (expert parallelism is carved out of data parallelism)."""

    tp: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel size: each layer's weights split over tp ranks.",
    )
    pp: int = Field(
        default=1, ge=1, description="Pipeline-parallel size: the layers split into pp stages."
    )
    ep: int = Field(
        default=1,
        ge=1,
        description="Expert-parallel size (mixture-of-experts models): the experts of each "
        "layer split over ep ranks.",
    )
    sp: bool = Field(
        default=False,
        description="Sequence parallelism: activations outside attention and MLP split along "
        "the sequence over the tp ranks (needs tp > 1).",
    )
    vpp: int | None = Field(
        default=None,
        ge=2,
        description="Virtual pipeline stages per rank (the interleaved 1F1B schedule; needs "
        "pp > 1). None: one stage per rank.",
    )
    cp: int = Field(
        default=1,
        ge=1,
        description="Context parallelism. Only 1: megatron-core's context parallel attention "
        "needs Transformer Engine (CUDA).",
    )

    @model_validator(mode="after")
    def _layout(self) -> MegatronConfig:
        if self.cp != 1:
            raise ValueError(
                f"actor_train.megatron.cp={self.cp}: context parallelism needs Transformer "
                "Engine's attention (CUDA builds of megatron-core with transformer-engine), "
                "which roll does not use. Set cp: 1 and split long sequences with tp + sp"
            )
        if self.sp and self.tp == 1:
            raise ValueError(
                "actor_train.megatron.sp needs tp > 1 (sequence parallelism splits the "
                "sequence over the tensor-parallel ranks). Set tp: 2 or more, or sp: false"
            )
        if self.vpp is not None and self.pp == 1:
            raise ValueError(
                f"actor_train.megatron.vpp={self.vpp} needs pp > 1 (virtual stages interleave "
                "a pipeline). Set pp: 2 or more, or remove vpp"
            )
        return self


class ActorTrainConfig(Strict):
    """The role that trains the policy: its backend, devices and optimizer."""

    backend: Literal["torch", "fsdp2", "deepspeed", "megatron"] = Field(
        default="torch",
        description="Train backend. `torch`: one process, CPU or one CUDA device. `fsdp2`: "
        "PyTorch FSDP2, parameters/gradients/optimizer sharded over `world_size` ranks. "
        "`deepspeed`: DeepSpeed ZeRO stage 1/2/3 (the `deepspeed` extra). `megatron`: "
        "megatron-core with tensor, pipeline, expert and data parallelism (the `megatron` "
        "section; needs megatron-core 0.16, in the `dev` extra).",
    )
    world_size: int = Field(
        default=1,
        ge=1,
        description="Data-parallel ranks, each its own process (a Ray actor, or a subprocess "
        "with the local executor) in one torch.distributed group: gloo on CPU, nccl on GPU. "
        "More than 1 needs backend fsdp2 or deepspeed.",
    )
    fsdp2: FSDP2Config | None = Field(
        default=None, description="FSDP2 options (backend fsdp2; None: the defaults)."
    )
    deepspeed: DeepSpeedConfig | None = Field(
        default=None, description="DeepSpeed options (backend deepspeed; None: the defaults)."
    )
    megatron: MegatronConfig | None = Field(
        default=None,
        description="Megatron-core layout: tp, pp, ep, sp, vpp (backend megatron; None: all 1, "
        "pure data parallelism).",
    )
    device_mapping: list[int] | None = Field(
        default=None,
        description="GPU ids (over the whole Ray cluster: node k holds ids k*gpus_per_node ..) "
        "this role runs on. Roles whose mappings overlap are colocated and take turns "
        "(weights, grads and optimizer state offloaded between phases); disjoint mappings "
        "run side by side. None: CPU, or GPUs in the order roles are listed.",
    )
    num_gpus_per_worker: int = Field(
        default=1, ge=1, description="GPUs of each rank (1 for data-parallel training)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="`auto` picks CUDA when available, else CPU."
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto",
        description="`bf16`: bfloat16 autocast (CUDA); `auto`: bf16 on CUDA, fp32 on CPU.",
    )
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch CPU threads in the worker (None: torch's default). Set it to get "
        "identical numbers across executors.",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer.")
    lora: LoraConfig | None = Field(
        default=None,
        description="LoRA adapters (None: full fine-tuning). Checkpoints then hold the adapters "
        "only; the final export merges them into a plain Hugging Face model.",
    )
    packing: bool = Field(
        default=True,
        description="Pack each micro-batch: its rows concatenated (one sequence for "
        "flash attention; with sdpa / eager / flex, whose mask is dense, into sequences of the "
        "width that keeps that mask smallest) with per-row position ids and attention confined "
        "to each row, so no forward or backward "
        "(update, log-prob passes, the teacher's targets) computes on padding. Same loss, "
        "gradients and log-probs as the padded path (within float rounding). false: "
        "right-padded micro-batches (debugging, or a model whose attention cannot take packed "
        "input). The megatron backend's own ranks always pad; with it this key sets how the "
        "torch roles beside them (the critic, distill's teacher) batch.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        gt=0,
        description="Token budget of one micro-batch (replaces the row count "
        "`trainer.micro_batch_size` when set): rows are grouped by length so each micro-batch "
        "holds at most this many tokens (packed: real tokens; padded: rows x longest row), so "
        "peak memory is set by the budget, not by the longest rows that happen to meet. Must "
        "be at least the longest row (prompt + response). null: count rows.",
    )

    logit_chunk_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Positions whose logits exist at a time in every pass that needs "
        "per-token log-probs (the update, old / reference log-probs, the teacher, SFT, DPO): "
        "the model's forward stops at its last hidden states and the output layer runs on "
        "this many positions at a time, recomputed in the backward, so no [tokens x "
        "vocabulary] tensor is held for it (roll_core/backends/train/lm_head.py). null: about "
        "16M logits per chunk (110 positions of a 151,936-token vocabulary; one chunk for a "
        "small one). 0: the whole micro-batch's logits at once (no chunking). Same log-probs, "
        "entropies and gradients either way (float summation order aside); every backend "
        "(megatron: each tensor-parallel rank computes its vocabulary shard of a chunk and the "
        "ranks gather it; DeepSpeed ZeRO-3 gathers its partitioned output layer once per "
        "chunk).",
    )

    @model_validator(mode="after")
    def _backend_options(self) -> ActorTrainConfig:
        if self.world_size > 1 and self.backend == "torch":
            raise ValueError(
                f"actor_train.world_size={self.world_size} needs a multi-rank backend: set "
                "actor_train.backend to fsdp2 or deepspeed, or megatron (torch runs one process)"
            )
        for name in ("fsdp2", "deepspeed", "megatron"):
            if getattr(self, name) is not None and self.backend != name:
                raise ValueError(
                    f"actor_train.{name} options are set but actor_train.backend is "
                    f"{self.backend}: set backend: {name} or remove the {name} section"
                )
        if self.megatron is not None:
            m = self.megatron
            if self.world_size % (m.tp * m.pp * m.ep):
                raise ValueError(
                    f"actor_train.world_size={self.world_size} is not a multiple of "
                    f"megatron tp x pp x ep = {m.tp} x {m.pp} x {m.ep} = {m.tp * m.pp * m.ep}: "
                    "set world_size to a multiple of it (the rest is data parallelism)"
                )
        # megatron's pipeline schedule takes micro-batches of a fixed row count, right-padded
        if self.backend == "megatron" and self.max_tokens_per_micro_batch is not None:
            raise ValueError(
                "actor_train.max_tokens_per_micro_batch is not supported by the megatron "
                "backend (its schedule takes micro-batches of trainer.micro_batch_size "
                "rows): remove it, or use backend torch / fsdp2 / deepspeed"
            )
        if self.lora is not None and self.backend != "torch":
            raise ValueError(
                f"actor_train.lora is supported by the torch backend only (backend is "
                f"{self.backend}: roll's peft adapters do not wrap its sharded layers): remove "
                "actor_train.lora to fine-tune every weight, or set actor_train.backend: torch"
            )
        if self.device_mapping is not None:
            if len(set(self.device_mapping)) != len(self.device_mapping):
                raise ValueError(
                    f"actor_train.device_mapping has repeated GPU ids: {self.device_mapping}"
                )
            need = self.world_size * self.num_gpus_per_worker
            if need > len(self.device_mapping):
                raise ValueError(
                    f"actor_train needs world_size x num_gpus_per_worker = {need} GPUs but "
                    f"device_mapping lists {len(self.device_mapping)}"
                )
        return self


class TrainerConfig(Strict):
    """The driver loop: how many steps, how big a batch."""

    max_steps: int = Field(ge=1, description="Optimizer steps to run.")
    micro_batch_size: int = Field(
        default=8, ge=1, description="Rows per forward/backward pass on one rank."
    )
    grad_accum_steps: int = Field(
        default=1, ge=1, description="Micro-batches accumulated into one optimizer step."
    )
    log_every_steps: int = Field(default=1, ge=1, description="Log metrics every N steps.")

    def global_batch_size(self, world_size: int) -> int:
        return self.micro_batch_size * self.grad_accum_steps * world_size


class EvalConfig(Strict):
    """Periodic evaluation on `data.eval`."""

    every_steps: int | None = Field(
        default=None,
        ge=1,
        description="Evaluate every N steps and at the end (None: only at the end).",
    )
    batch_size: int = Field(default=64, ge=1, description="Rows per evaluation batch.")
    max_samples: int | None = Field(
        default=None, ge=1, description="Evaluate on at most this many rows (None: all)."
    )
    exact_match: bool = Field(
        default=False,
        description="Also generate greedily for each prompt and report `eval/exact_match`: the "
        "fraction whose stripped output equals the reference answer.",
    )
    answer_key: str | None = Field(
        default=None,
        description="Column with the reference answer for exact match (None: the response).",
    )
    max_new_tokens: int = Field(default=32, ge=1, description="Generation budget for exact match.")


class CheckpointConfig(Strict):
    """When to save, how many to keep, and the final export."""

    every_steps: int | None = Field(
        default=None,
        ge=1,
        description="Save a full checkpoint every N steps (None: only at the end).",
    )
    keep_last: int = Field(default=2, ge=1, description="Complete checkpoints kept on disk.")
    export_final: bool = Field(
        default=True,
        description="Write the final model in Hugging Face format to `runs/<id>/final/`.",
    )


class ExecutorConfig(Strict):
    """Where workers run."""

    type: Literal["local", "ray"] = Field(
        default="local",
        description="`local`: every worker in the driver process (no Ray; debugging and single "
        "device). `ray`: workers are Ray actors.",
    )
    ray_address: str | None = Field(
        default=None,
        description="Ray cluster to join (`auto` or `ray://host:port`). None starts a local one.",
    )
    num_cpus: int | None = Field(
        default=None, ge=1, description="CPUs for a local Ray cluster (None: Ray's choice)."
    )
    num_gpus: int | None = Field(
        default=None,
        ge=0,
        description="GPUs the Ray cluster has in all (for `--dry-run` and plan checks; None: "
        "the largest GPU id any role's device_mapping uses, + 1).",
    )
    gpus_per_node: int = Field(
        default=8, ge=1, description="GPUs per node: GPU id g lives on node g // gpus_per_node."
    )
    gpu_memory_gib: float = Field(
        default=80.0,
        gt=0,
        description="Memory of one GPU; `--dry-run` flags GPUs whose estimate exceeds it.",
    )

    @model_validator(mode="after")
    def _ray_keys_need_ray(self) -> ExecutorConfig:
        for key in ("ray_address", "num_cpus"):
            if self.type == "local" and getattr(self, key) is not None:
                raise ValueError(
                    f"executor.{key} only applies to the Ray executor and executor.type is "
                    f"local, so it would have no effect: set executor.type: ray or remove "
                    f"executor.{key}"
                )
        if self.ray_address is not None and self.num_cpus is not None:
            raise ValueError(
                "executor.num_cpus sizes a Ray cluster roll starts itself; with "
                "executor.ray_address roll joins a running one whose CPUs are fixed (`ray start "
                "--num-cpus`), so it would have no effect: remove one of the two"
            )
        return self


TrackerName = Literal["console", "jsonl", "tensorboard", "swanlab", "wandb"]


class TrackingConfig(Strict):
    """Where metrics go. metrics.jsonl in the run directory is always written."""

    backends: list[TrackerName] = Field(
        default_factory=lambda: list[TrackerName](["console", "jsonl", "tensorboard"]),
        description="Any of console, jsonl, tensorboard, swanlab (offline mode: no account, "
        "no network), wandb (when installed).",
    )
    project: str = Field(default="roll", description="Project name for SwanLab / W&B.")
    time_split_every: int | None = Field(
        default=10,
        ge=1,
        description="RL pipelines: print a line with the step's time split (rollout, "
        "log-probs, train, sync) on the console every N steps; null: never.",
    )


class RunConfig(Strict):
    """The sections every recipe has, whatever its pipeline."""

    pipeline: str = Field(description="Which pipeline this recipe is for.")
    name: str | None = Field(
        default=None,
        description="Human name of the experiment, shown by `roll runs` (None: the pipeline's "
        "name).",
    )
    seed: int = Field(
        default=0, description="Seed for initialisation, shuffling, sampling and env seeds."
    )
    runs_dir: str = Field(
        default="runs", description="Parent directory of run directories (`runs/<run-id>/`)."
    )
    model: ModelConfig = Field(
        description="The model that is trained: the starting policy, which is also the "
        "reference policy of DPO and of KL terms (the student in `roll distill`)."
    )
    actor_train: ActorTrainConfig = Field(
        default_factory=ActorTrainConfig, description="The training role."
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints and export."
    )
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig, description="Executor.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="Trackers.")

    @model_validator(mode="after")
    def _default_name(self) -> RunConfig:
        if self.name is None:
            self.name = self.pipeline
        return self

    @model_validator(mode="after")
    def _budget_holds_the_longest_row(self) -> RunConfig:
        budget = self.actor_train.max_tokens_per_micro_batch
        longest = longest_train_row(self)
        if budget is not None and longest is not None and budget < longest[0]:
            raise ValueError(
                f"actor_train.max_tokens_per_micro_batch={budget} is smaller than the longest "
                f"micro-batch unit this recipe allows ({longest[1]} = {longest[0]} tokens): "
                f"set it to at least {longest[0]}, or remove it to count rows"
            )
        return self


def longest_train_row(cfg: Any) -> tuple[int, str] | None:
    """(tokens, how they are counted) of the longest unit a train micro-batch must hold, from
    the recipe's length limits: rlvr `data.max_prompt_length + rollout.max_new_tokens`,
    agentic `rollout.max_context`, sft / distill `data.max_length`, dpo a pair of
    `data.max_length` rows; None when the recipe sets no limit."""
    data, rollout = getattr(cfg, "data", None), getattr(cfg, "rollout", None)
    prompt = getattr(data, "max_prompt_length", None)
    new_tokens = getattr(rollout, "max_new_tokens", None)
    if prompt is not None and new_tokens is not None:
        return prompt + new_tokens, "data.max_prompt_length + rollout.max_new_tokens"
    context = getattr(rollout, "max_context", None)
    if context is not None:
        return int(context), "rollout.max_context"
    length = getattr(data, "max_length", None)
    if length is None:
        return None
    if cfg.pipeline == "dpo":  # chosen and rejected share a micro-batch
        return 2 * length, "a (chosen, rejected) pair: 2 x data.max_length"
    return int(length), "data.max_length"


class SupervisedConfig(RunConfig):
    """The sections of the supervised pipelines (sft, dpo, distill): batches of a dataset."""

    trainer: TrainerConfig = Field(description="Driver loop.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")

    @model_validator(mode="after")
    def _eval_needs_data(self) -> SupervisedConfig:
        has_eval_data = getattr(self, "data").eval is not None  # noqa: B009 - data is per pipeline
        if self.eval.every_steps is not None and not has_eval_data:
            raise ValueError("eval.every_steps is set but data.eval is not: add data.eval.path")
        if self.eval.exact_match and not has_eval_data:
            raise ValueError(
                "eval.exact_match is true but data.eval is not set: add data.eval.path"
            )
        return self


class SFTConfig(SupervisedConfig):
    """`roll sft`: supervised fine-tuning with the loss on response tokens."""

    pipeline: Literal["sft"] = Field(
        default="sft", description="Which pipeline this recipe is for."
    )
    data: SFTDataConfig = Field(description="Training and evaluation data.")
