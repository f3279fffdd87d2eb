"""The GPU side of `--dry-run`: placement per node and the memory estimate per GPU, from a
validated recipe (no model is loaded, nothing is downloaded).

A recipe has a GPU plan when a role asks for CUDA, a role has a device_mapping, or
`executor.num_gpus` is set; CPU recipes have none (and print nothing extra).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from roll_core.config.schema import RunConfig
from roll_core.engine.model_sizes import model_shape
from roll_core.engine.placement import (
    GpuMemory,
    LogitsSpec,
    Placement,
    RoleRequest,
    TrainMemorySpec,
    checkpointed_activations,
    gib,
    gpu_memory,
    infer_memory,
    logits_memory,
    place,
    span,
    train_memory,
)
from roll_core.errors import ConfigError

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SHORT = {
    "params": "params",
    "grads": "grads",
    "optimizer": "optim",
    "kv_cache": "kv",
    "logits": "logits while training",
    "activations": "checkpointed layer inputs",
    "reference": "frozen reference",
}


@dataclass
class GpuPlan:
    placement: Placement
    memory: list[GpuMemory]
    model_note: str
    gpu_memory_gib: float

    def colocation(self) -> str:
        pairs = self.placement.colocated()
        if pairs:
            return "colocated (take turns on shared GPUs; see the colocation row): " + ", ".join(
                f"{a} + {b}" for a, b in pairs
            )
        return "disaggregated: no GPU is shared between roles"

    def memory_groups(self) -> list[tuple[list[int], str]]:
        """(GPU ids, estimate text); GPUs with the same estimate are grouped."""
        groups: dict[str, list[int]] = {}
        limit = self.gpu_memory_gib
        for mem in self.memory:
            if not mem.roles:
                continue
            parts = []
            for role, comps in mem.roles.items():
                inner = ", ".join(f"{_SHORT.get(k, k)} {v / 1024**3:.1f}" for k, v in comps.items())
                parts.append(f"{role} {gib(sum(comps.values()))} ({inner})")
            text = " + ".join(parts)
            if len(mem.roles) > 1:
                text += (
                    f"; {gib(mem.resident)} if both stay on the GPU, "
                    f"{gib(mem.peak_taking_turns)} if each leaves it while the other works"
                )
            if len(mem.roles) > 1 and mem.resident / 1024**3 <= limit:
                text += f"; fits {limit:g} GiB with both on the GPU: nothing has to move"
            if mem.resident / 1024**3 > limit:
                if mem.peak_taking_turns / 1024**3 <= limit:
                    text += f"; fits {limit:g} GiB only by moving memory between phases"
                else:
                    text += (
                        f"; EXCEEDS {limit:g} GiB: shard more, offload, lower the KV need or "
                        "trainer.micro_batch_size"
                    )
            groups.setdefault(text, []).append(mem.gpu)
        return [(gpus, text) for text, gpus in groups.items()]

    def lines(self) -> list[str]:
        """The plan as text: one line per node, the colocation, the memory per GPU."""
        p = self.placement
        out = [f"placement: {p.num_gpus} GPUs on {p.num_nodes} node(s)"]
        out += ["  " + line for line in p.node_lines()]
        out.append("  " + self.colocation())
        out.append(f"memory per GPU ({self.model_note}):")
        out += [f"  GPUs {span(gpus)}: {text}" for gpus, text in self.memory_groups()]
        return out


def _kv_tokens(cfg: RunConfig, infer_ranks: int) -> int:
    """Tokens in flight on one inference rank: the samples per rank (streaming: every request
    of a step is sent at once; deterministic: at most chunk_size x chunks in flight) sequences
    of prompt + response length (0 when the recipe does not say)."""
    r = getattr(cfg, "rollout", None)
    fields = ("n", "prompts_per_step", "chunk_size", "max_chunks_in_flight", "max_new_tokens")
    if r is None or not all(hasattr(r, f) for f in fields):
        return 0  # e.g. agentic rollouts: multi-turn lengths are not known up front
    seqs = r.n * r.prompts_per_step // max(1, infer_ranks)
    if getattr(r, "deterministic", False):
        seqs = min(seqs, r.chunk_size * r.max_chunks_in_flight)
    seq_len = getattr(getattr(cfg, "data", None), "max_prompt_length", 0) + r.max_new_tokens
    return max(1, seqs) * seq_len


def _logits_spec(cfg: RunConfig, dtype_bytes: int) -> LogitsSpec | None:
    """The sizes of one micro-batch of the RL objective (placement.logits_memory); None when
    the recipe does not bound them (SFT / DPO / distill, agentic without rollout.max_context).
    rlvr: max_prompt_length + max_new_tokens positions, max_new_tokens of them responses;
    agentic: rollout.max_context positions, max_new_tokens of them responses in step mode,
    all of them in trajectory mode."""
    rollout, trainer = getattr(cfg, "rollout", None), getattr(cfg, "trainer", None)
    if rollout is None or trainer is None or not hasattr(trainer, "micro_batch_size"):
        return None
    prompt = getattr(getattr(cfg, "data", None), "max_prompt_length", None)
    if prompt is not None:
        seq, response = prompt + rollout.max_new_tokens, rollout.max_new_tokens
    elif getattr(rollout, "max_context", None):
        seq = rollout.max_context
        # step mode trains one turn's response per row; a trajectory's turns may fill it
        response = rollout.max_new_tokens if rollout.mode == "step" else seq
    else:
        return None
    train = cfg.actor_train
    bf16 = getattr(train, "precision", "auto") != "fp32"  # auto: bf16 on a GPU
    logits_bytes = 2 if dtype_bytes < 4 or bf16 else 4
    budget = getattr(train, "max_tokens_per_micro_batch", None)
    # every backend computes the output layer in chunks (backends/train/lm_head.py; megatron
    # gathers each chunk's vocabulary shards, so a chunk holds the whole vocabulary there too)
    chunk = getattr(train, "logit_chunk_tokens", None)
    return LogitsSpec(
        trainer.micro_batch_size,
        seq,
        response,
        logits_bytes,
        max_tokens=budget,
        chunk_tokens=chunk,
    )


def _uses_gpus(cfg: RunConfig) -> bool:
    roles = [getattr(cfg, n, None) for n in ("actor_train", "actor_infer")]
    return (
        getattr(cfg.executor, "num_gpus", None) is not None
        or any(getattr(r, "device_mapping", None) is not None for r in roles if r is not None)
        or any(getattr(r, "device", None) == "cuda" for r in roles if r is not None)
    )


def _add_activations(cfg: RunConfig, shape: Any, train_mem: dict[str, float]) -> str:
    """Add one micro-batch's logits (and, with gradient checkpointing, the layer inputs it
    keeps) to actor_train's memory; return what the plan's note says about them."""
    logits = _logits_spec(cfg, _BYTES[cfg.model.dtype])
    if logits is None:
        return "; activations not included"
    train_mem["logits"] = logits_memory(shape, logits)
    if cfg.model.gradient_checkpointing:
        train_mem["activations"] = checkpointed_activations(shape, logits)
        return "; one micro-batch's logits and checkpointed layer inputs included"
    return (
        "; one micro-batch's logits included, not the layer activations "
        "(model.gradient_checkpointing: false)"
    )


def _megatron_note(train: Any) -> str:
    """The megatron layout for the plan's note ("" for other backends)."""
    if train.backend != "megatron":
        return ""
    mg = getattr(train, "megatron", None)
    tp, pp, ep = (mg.tp, mg.pp, mg.ep) if mg else (1, 1, 1)
    return (
        f"; megatron tp{tp} x pp{pp} x ep{ep}, data parallel {train.world_size // (tp * pp)}"
        + (f", {mg.vpp} virtual stages" if mg and mg.vpp else "")
        + (", sequence parallel" if mg and mg.sp else "")
    )


def _train_memory_spec(cfg: RunConfig) -> TrainMemorySpec:
    """What actor_train's memory estimate depends on: backend, ranks, dtype, ZeRO / FSDP2
    offload, LoRA, the megatron layout."""
    train = cfg.actor_train
    ds = getattr(train, "deepspeed", None)
    fsdp = getattr(train, "fsdp2", None)
    mg = getattr(train, "megatron", None)
    return TrainMemorySpec(
        backend=train.backend,
        world_size=train.world_size,
        param_bytes=_BYTES[cfg.model.dtype],
        zero_stage=(ds.zero_stage if ds else 2) if train.backend == "deepspeed" else 0,
        offload_optimizer=bool(ds and ds.offload_optimizer),
        offload_param=bool(ds and ds.offload_param),
        cpu_offload=bool(fsdp and fsdp.cpu_offload),
        lora=train.lora is not None,
        **({"tp": mg.tp, "pp": mg.pp, "ep": mg.ep} if mg else {}),
    )


def gpu_plan(cfg: RunConfig) -> GpuPlan | None:
    """Placement and memory of a recipe's GPU roles; None for a CPU recipe. Raises
    ConfigError for an impossible plan."""
    if not _uses_gpus(cfg):
        return None
    train = cfg.actor_train
    requests = [
        RoleRequest(
            "actor_train",
            train.world_size,
            train.num_gpus_per_worker,
            tuple(train.device_mapping) if train.device_mapping is not None else None,
        )
    ]
    infer = getattr(cfg, "actor_infer", None)
    tp = 1
    if infer is not None:
        vllm = getattr(infer, "vllm", None)
        tp = int(
            getattr(infer, "num_gpus_per_worker", None)
            or getattr(vllm, "tensor_parallel_size", None)
            or 1
        )
        mapping = getattr(infer, "device_mapping", None)
        requests.append(
            RoleRequest(
                "actor_infer",
                infer.world_size,
                tp,
                tuple(mapping) if mapping is not None else None,
            )
        )
    placement = place(
        requests, num_gpus=cfg.executor.num_gpus, gpus_per_node=cfg.executor.gpus_per_node
    )
    shape = model_shape(cfg.model.path)
    per_role: dict[str, dict[str, float]] = {}
    if shape is None:
        note = f"model {cfg.model.path}: size unknown offline, no estimate"
    else:
        note = f"{cfg.model.path}: {shape.params / 1e9:.2f}B params"
        if shape.vision_params:
            note += f" ({shape.vision_params / 1e9:.2f}B of them the vision tower)"
        if shape.num_experts:
            note += f", {shape.active_params / 1e9:.2f}B active (MoE)"
        note += _megatron_note(train)
        per_role["actor_train"] = train_memory(shape, _train_memory_spec(cfg))
        if train.backend == "megatron" and getattr(
            getattr(cfg, "algorithm", None), "uses_reference", False
        ):  # KL's reference: a frozen twin of the policy's shards, on its GPUs all run long
            per_role["actor_train"]["reference"] = per_role["actor_train"]["params"]
        note += _add_activations(cfg, shape, per_role["actor_train"])
        if infer is not None:
            kv_tokens = _kv_tokens(cfg, infer.world_size)
            infer_bytes = 2 if infer.backend == "vllm" else _BYTES[cfg.model.dtype]
            if vllm is not None and vllm.dtype in _BYTES:
                infer_bytes = _BYTES[vllm.dtype]
            mem = infer_memory(
                shape, tensor_parallel=tp, dtype_bytes=infer_bytes, kv_tokens=kv_tokens
            )
            if infer.backend == "vllm":  # vLLM takes its share of the GPU, whatever the need
                util = vllm.gpu_memory_utilization if vllm is not None else 0.5
                budget = util * cfg.executor.gpu_memory_gib * 1024**3
                mem["kv_cache"] = max(0.0, budget - mem["params"])
                note += f"; vllm reserves {util:g} x GPU"
            per_role["actor_infer"] = mem
    memory = gpu_memory(placement, per_role)
    note += _add_frozen_teachers(cfg, placement, memory)
    return GpuPlan(placement, memory, note, cfg.executor.gpu_memory_gib)


def _add_frozen_teachers(cfg: RunConfig, placement: Any, memory: list[Any]) -> str:
    """On-policy distillation's teachers (frozen, resident in every phase) on actor_train's
    first GPU, as a `teachers` part of its state (so the colocation choice counts them in
    every phase and never offloads them); a note when a teacher's size is unknown offline."""
    opd = getattr(getattr(cfg, "algorithm", None), "on_policy_distill", None)
    placed = placement.roles.get("actor_train")
    if opd is None or placed is None:
        return ""
    total, unknown = 0.0, []
    for role, t in opd.named_teachers().items():
        shape = model_shape(t.path or cfg.model.path)
        if shape is None:
            unknown.append(role)
        else:
            total += shape.params * _BYTES[t.dtype]
    first = memory[placed.gpus[0]]
    if total and "actor_train" in first.roles:
        first.roles["actor_train"] = {**first.roles["actor_train"], "teachers": total}
    return f"; teacher size unknown offline: {', '.join(unknown)}" if unknown else ""


# ---- can the executor place every rank? (CPU recipes; GPU recipes are placed above) --------

_CLUSTER_WORKERS = ("ActorTrain", "ActorInfer", "Reference", "Critic", "Teacher")
"""Plan rows that are Clusters of ranks (not thread pools such as rewards or envs)."""


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask, e.g. a container's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _ranks(rows: list[Any], *, process_groups_only: bool) -> list[tuple[str, int]]:
    """(role, ranks) of every cluster in the plan; a LoRA reference shares actor_train's.
    ``process_groups_only``: actor_train's processes (a megatron reference's ranks take turns
    with them, never computing at the same time: not counted)."""
    out = []
    for row in rows:
        if row.worker not in _CLUSTER_WORKERS:
            continue
        if row.worker == "ActorTrain" and row.role != "actor_train":
            continue
        if process_groups_only and not (
            row.worker == "ActorTrain" and (row.world_size > 1 or row.backend != "torch")
        ):
            continue
        out.append((row.role, row.world_size))
    return out


def check_megatron_layout(cfg: RunConfig) -> None:
    """actor_train.megatron against the model (see backends/train/megatron_model.py)."""
    train = getattr(cfg, "actor_train", None)
    if train is None or train.backend != "megatron":
        return
    from roll_core.backends.train.megatron_model import check_recipe_layout
    from roll_core.config.schema import MegatronConfig
    from roll_core.engine.model_sizes import model_config

    config = model_config(cfg.model.path)
    if config is not None and "model_type" not in config:  # a builtin's table entry
        from roll_core.models.builtin import BUILTIN_PREFIX, get_builtin

        if cfg.model.path.startswith(BUILTIN_PREFIX):
            config["model_type"] = get_builtin(cfg.model.path).model_type
    if config is not None and "model_type" in config:  # the offline table may not say
        check_recipe_layout(config, train.megatron or MegatronConfig(), train.world_size)


def check_capacity(cfg: RunConfig, rows: list[Any]) -> None:
    """Refuse a CPU recipe whose ranks the executor cannot place, before anything starts.

    `local`: ranks in a torch.distributed group each get a process that computes in lock-step
    with the others; more of them than this machine's CPUs is refused. `ray` (a local
    cluster): every rank is an actor holding 1 CPU for the whole run, so the ranks of all roles
    together must fit in `executor.num_cpus` (or this machine's CPUs); more would wait for
    resources forever. A joined cluster (`executor.ray_address`) is checked against its
    resources when it is joined (RayExecutor). GPU recipes are placed by gpu_plan.

    A `megatron` layout is checked against the model's config.json first (when it is known
    offline): layers, experts and heads it cannot split are recipe errors here.
    """
    check_megatron_layout(cfg)
    ex = cfg.executor
    if ex.num_gpus or any(row.device == "cuda" for row in rows):
        return
    if ex.type == "ray":
        if ex.ray_address:
            return
        roles = _ranks(rows, process_groups_only=False)
        capacity = ex.num_cpus or available_cpus()
        where = (
            f"executor.num_cpus={ex.num_cpus}"
            if ex.num_cpus
            else f"this machine's {capacity} CPUs (executor.num_cpus unset)"
        )
        fix = "Raise executor.num_cpus, lower the world_size of a role, or join a larger "
        fix += "cluster with executor.ray_address."
    else:
        roles = _ranks(rows, process_groups_only=True)
        capacity = available_cpus()
        where = f"this machine's {capacity} CPUs"
        fix = "Lower actor_train.world_size, or run on Ray across machines (executor.type: ray "
        fix += "with executor.ray_address)."
    need = sum(n for _, n in roles)
    if need > capacity:
        parts = " + ".join(f"{role} {n}" for role, n in roles)
        raise ConfigError(
            f"the resource plan needs {need} CPU ranks ({parts}), more than the {ex.type} "
            f"executor can place on {where}; the run would wait for them forever or crawl.",
            hint=fix,
        )
