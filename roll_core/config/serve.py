"""The recipe of `roll serve` (``pipeline: serve``): the Tinker training API on this machine.

Not a training pipeline: no data, no steps. The client (PyPI ``tinker``, tinker-cookbook)
decides what to train, on which loss, with which Adam hyper-parameters; the recipe decides
which models are served under which names, how large a LoRA rank may be asked for, which
backend trains and which engine samples, and where the server listens and keeps checkpoints.
See docs/serve.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from roll_core.config.schema import Strict


class ServedModel(Strict):
    """One model the server trains and samples, under the name clients ask for."""

    name: str = Field(
        min_length=1,
        description="The name clients pass as `base_model` (tinker-cookbook names hub models, "
        "e.g. `Qwen/Qwen3-8B`); any string, matched exactly.",
    )
    path: str = Field(
        min_length=1,
        description="`builtin:NAME` (see `roll models`) or a local Hugging Face model "
        "directory: the weights served under `name`.",
    )
    tokenizer: str | None = Field(
        default=None, description="Tokenizer location when it differs from `path`."
    )
    max_context_length: int = Field(
        default=4096,
        ge=8,
        description="Longest sequence (prompt + sampled tokens, or one training datum) "
        "accepted; longer requests fail with a user error.",
    )


class ServeLoraConfig(Strict):
    """LoRA adapters of the training clients: each `create_model` gets its own adapter on a
    frozen copy of the base model (roll_core/models/lora.py, `peft`)."""

    max_rank: int = Field(
        default=64, ge=1, description="Largest LoRA rank a client may ask for (larger: refused)."
    )
    alpha: float = Field(
        default=32.0,
        gt=0,
        description="LoRA alpha of every adapter: an adapter adds (alpha / rank) * B @ A.",
    )


class ServeTrainConfig(Strict):
    """How training clients' models train."""

    backend: Literal["torch"] = Field(
        default="torch",
        description="Train backend: `torch` (one process, CPU or one CUDA device). The "
        "sharded backends are not served yet.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Device of the trained models and the samplers."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="Dtype of the base weights."
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="fp32",
        description="Compute precision: fp32, bf16 autocast, or auto (bf16 on CUDA).",
    )
    num_threads: int | None = Field(
        default=None, ge=1, description="torch CPU threads (None: torch's default)."
    )
    seed: int = Field(
        default=0, description="Seed of LoRA initialisation when the client gives none."
    )
    logit_chunk_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Positions whose logits exist at a time in `forward` / "
        "`forward_backward` (as actor_train.logit_chunk_tokens: the output layer runs on "
        "this many positions at a time, recomputed in the backward). null: about 16M logits "
        "per chunk; 0: a micro-batch's logits at once. Same log-probs and gradients either way.",
    )


class ServeSampleConfig(Strict):
    """How sampling clients sample."""

    engine: Literal["hf", "vllm"] = Field(
        default="hf",
        description="Inference engine: `hf` (roll's request-level transformers engine, "
        "continuous batching): one engine per sampling session, holding its weights merged "
        "with the client's adapter; `vllm` (the `cpu` or `gpu` extra): one vLLM engine per "
        "served model, started with the server, each sampling session a LoRA adapter it "
        "loads per request (no model copy per session; every session's requests batched "
        "together).",
    )
    cpu_kv_cache_gb: float | None = Field(
        default=None,
        gt=0,
        description="vllm on the CPU build: host memory for each engine's KV cache, in GiB "
        "(null: 1). An error with the hf engine.",
    )
    max_num_seqs: int = Field(
        default=64, ge=1, description="Sequences one engine decodes at a time (the rest queue)."
    )
    max_samplers: int = Field(
        default=8,
        ge=1,
        description="Sampling sessions open at once (hf: each holds an engine and its "
        "weights; vllm: each holds an adapter, and this many adapters fit in one batch); "
        "opening one more closes the least recently used, whose later requests fail with a "
        "user error (an RL loop opens one per step and drops the old).",
    )

    @model_validator(mode="after")
    def _vllm_only(self) -> ServeSampleConfig:
        if self.engine != "vllm" and self.cpu_kv_cache_gb is not None:
            raise ValueError("cpu_kv_cache_gb sizes the vllm engine's KV cache; engine is hf")
        return self


class ServeConfig(Strict):
    """`roll serve RECIPE`: an HTTP server speaking the Tinker API (docs/serve.md)."""

    pipeline: Literal["serve"] = Field(description="Always `serve`.")
    models: list[ServedModel] = Field(
        min_length=1, description="The models served, each under its own name."
    )
    lora: ServeLoraConfig = Field(default_factory=ServeLoraConfig, description="LoRA limits.")
    train: ServeTrainConfig = Field(default_factory=ServeTrainConfig, description="Training side.")
    sample: ServeSampleConfig = Field(
        default_factory=ServeSampleConfig, description="Sampling side."
    )
    executor: Literal["local"] = Field(
        default="local",
        description="`local`: every model and sampler in the server's process (Ray is not "
        "served yet).",
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(
        default=8000, ge=0, le=65535, description="Port to listen on (0: any free port)."
    )
    checkpoints_dir: str = Field(
        default="serve_checkpoints",
        description="Directory of saved weights (`tinker://` paths map to folders under it); "
        "a restarted server finds the checkpoints saved here.",
    )
    session_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="A session without a heartbeat for this long is closed and its models "
        "and samplers freed.",
    )

    @model_validator(mode="after")
    def _names_unique(self) -> ServeConfig:
        names = [m.name for m in self.models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"models: name {dup[0]!r} is served twice; give each model one name")
        return self
