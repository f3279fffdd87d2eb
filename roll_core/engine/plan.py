"""A run's plan: computed once at launch from the validated recipe, then passed down.

`make_plan(cfg)` is the one place that places the GPU roles and estimates their memory
(resource_plan.gpu_plan), resolves what the colocated RL roles offload between turns
(colocation.resolve_offload) and picks the weight-sync path (weight_sync.planned_path). The
CLI's `--dry-run` prints it; `launch` / `resume` hand it to the pipeline through the
DriverLoop (`loop.plan`), and role building, turns and weight sync read it: nothing
recomputes it. An impossible plan is a ConfigError here, before anything starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from roll_core.config.agentic import AgenticConfig
from roll_core.config.recipes import RLRecipe
from roll_core.config.rlvr import RLVRConfig
from roll_core.config.schema import RunConfig
from roll_core.engine.colocation import OffloadChoice, resolve_offload
from roll_core.engine.resource_plan import GpuPlan, gpu_plan
from roll_core.engine.weight_sync import planned_path


@dataclass(frozen=True)
class SyncPlan:
    """The weight-sync path actor_train -> actor_infer as `--dry-run` shows it."""

    path: str
    note: str
    share: bool = False
    """`same_process` with a synchronous rollout and nothing offloaded: the hf engine takes
    the trainer's parameter storage (one model in memory; engine/weight_sync.py)."""


@dataclass(frozen=True)
class Plan:
    """Placement and memory of the GPU roles (`gpu`, None for a CPU recipe); for RL recipes
    the colocated roles' offload (`offload`) and the weight-sync path (`sync`)."""

    gpu: GpuPlan | None
    gpus_per_node: int
    offload: OffloadChoice | None = None
    sync: SyncPlan | None = None

    def placement_of(self, role: str) -> dict[str, Any]:
        """`Cluster(...)` keyword arguments that pin `role`'s ranks to their GPUs (`gpu_ids`,
        `gpus_per_node`); {} for a CPU recipe or a role the plan does not place."""
        if self.gpu is None or role not in self.gpu.placement.roles:
            return {}
        return {
            "gpu_ids": list(self.gpu.placement.roles[role].ranks),
            "gpus_per_node": self.gpus_per_node,
        }

    def gpus_of(self, role: str) -> list[int] | None:
        """The GPUs `role` is placed on (None: a CPU recipe, or not placed)."""
        if self.gpu is None or role not in self.gpu.placement.roles:
            return None
        return list(self.gpu.placement.roles[role].gpus)

    def rl(self) -> tuple[OffloadChoice, SyncPlan]:
        """The RL parts of the plan (a plan made from an RL recipe has both)."""
        if self.offload is None or self.sync is None:
            raise TypeError("this plan was made from a recipe without RL roles")
        return self.offload, self.sync


def make_plan(cfg: RunConfig) -> Plan:
    """The plan of a validated recipe (loads no model); ConfigError for one that cannot run."""
    gp = gpu_plan(cfg)
    per_node = cfg.executor.gpus_per_node
    if not isinstance(cfg, RLVRConfig | AgenticConfig):
        return Plan(gpu=gp, gpus_per_node=per_node)
    return _rl_plan(cfg, gp, per_node)


def _rl_plan(cfg: RLRecipe, gp: GpuPlan | None, per_node: int) -> Plan:
    """The RL parts: the sync path, the colocated offload, whether one model serves both."""
    path, note = planned_path(cfg, gp)
    offload = resolve_offload(cfg, gp)
    share = (
        path == "same_process"
        and cfg.actor_infer.backend == "hf"
        and cfg.rollout.async_generation_ratio == 0
        and not offload.active
    )
    if share:
        note = "the engine reads the trainer's parameters (one model in memory); " + note
        gp = _without_engine_weights(gp)
    elif path == "same_process":
        note = "in-place copies (async rollout or offload: the engine keeps its own); " + note
    sync = SyncPlan(path, note, share)
    return Plan(gpu=gp, gpus_per_node=per_node, offload=offload, sync=sync)


def _without_engine_weights(gp: GpuPlan | None) -> GpuPlan | None:
    """The memory estimate when actor_infer holds no weights of its own (`SyncPlan.share`):
    its `params` are actor_train's, counted there. The offload choice was made with them
    counted twice and moved nothing, so it stands."""
    if gp is None:
        return None
    memory = [
        dataclasses.replace(
            mem,
            roles={
                role: {k: v for k, v in parts.items() if (role, k) != ("actor_infer", "params")}
                for role, parts in mem.roles.items()
            },
        )
        for mem in gp.memory
    ]
    return dataclasses.replace(gp, memory=memory)
