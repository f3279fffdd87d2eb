"""MoE routing replay (R3, roll_core/models/routing.py) on megatron-core's routers.

megatron-core's `TopKRouter` takes a replay object (`router.router_replay`, the hook of its
own `RouterReplay`) whose ``get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk)`` gives each token's top-k (values, indices). roll puts its own object
there: the router's own top-k is computed first (counted against the record, for
``router/agreement``), then every token with a record takes the recorded experts and the
scores at them. The gate weights then come from the router's own logits at those experts as
megatron computes them (softmax over the k logits when the model renormalises its top-k,
the full softmax's values otherwise), so the gradient reaches the router weights, as in the
torch backends. Tokens without a record (padding, a response's last token) keep the
router's choice.

Token order: megatron's router sees a micro-batch as ``[sequence, batch]`` flattened
sequence-major, the local part of the sequence under sequence parallelism; :meth:`set` puts
the Batch's ``[B, T, L, K]`` routes of a micro-batch into that order (padded as the
micro-batch is). Layer ``l`` of the record is the router of megatron's layer number ``l + 1``
(every layer of the models the megatron backend builds is an MoE layer).

Activation recomputation (`model.gradient_checkpointing`) runs the router again in the
backward, after later micro-batches have set their routes: it is refused with replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from roll_core.errors import ConfigError
from roll_core.models.routing import NO_ROUTE, replayed_indices


def recompute_error() -> ConfigError:
    """Replay with megatron's activation recomputation (see the module docstring)."""
    return ConfigError(
        "algorithm.router_replay: r3 with model.gradient_checkpointing on the megatron "
        "backend: megatron recomputes the routers in the backward, after later "
        "micro-batches have set their routes, so it would replay the wrong ones.",
        hint="Set model.gradient_checkpointing: false, or use actor_train.backend: "
        "torch / fsdp2 / deepspeed (their recomputation replays the same routes).",
    )


class MegatronRouteReplay:
    """Replays the routes of each micro-batch in the routers of this rank's model chunks."""

    def __init__(self, chunks: list[Any], *, num_layers: int, tp: int, sp: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise ConfigError(
                "algorithm.router_replay is r3, but the trained model has no mixture-of-"
                "experts router (a dense model routes nothing).",
                hint="Set algorithm.router_replay: off for dense models.",
            )
        self.num_layers, self.tp, self.sp = num_layers, tp, sp
        self._flat: torch.Tensor | None = None
        self.matched = torch.zeros(num_layers, dtype=torch.float64)
        self.counted = torch.zeros(num_layers, dtype=torch.float64)
        for router in self.routers:
            router.router_replay = _LayerReplay(self, int(router.layer_number) - 1)

    def set(self, routes: torch.Tensor | None, *, rows: int = 0, width: int = 0) -> None:
        """The routes of the next forwards: ``[b, t, L, K]`` of a micro-batch that runs as
        `rows` x `width` (None: the routers choose)."""
        if routes is None:
            self._flat = None
            return
        if routes.shape[2] != self.num_layers:
            raise RuntimeError(
                f"router replay: the batch records {routes.shape[2]} MoE layers, the model "
                f"has {self.num_layers}"
            )
        b, t = routes.shape[:2]
        padded = torch.nn.functional.pad(
            routes.long(), (0, 0, 0, 0, 0, width - t, 0, rows - b), value=NO_ROUTE
        )
        seq_major = padded.transpose(0, 1)  # [width, rows, L, K], megatron's [s, b]
        if self.sp:  # this tensor-parallel rank routes its part of the sequence
            from megatron.core import parallel_state as ps

            part = width // self.tp
            rank = ps.get_tensor_model_parallel_rank()
            seq_major = seq_major[rank * part : (rank + 1) * part]
        self._flat = seq_major.reshape(-1, *seq_major.shape[2:])

    def reset_metrics(self) -> None:
        self.matched.zero_()
        self.counted.zero_()

    def metrics(self, *, scale: float = 1.0) -> dict[str, float]:
        """``router/agreement`` and ``router/agreement_layerNN`` over every rank's forwards
        since :meth:`reset_metrics` (a collective: every rank calls it), reported by global
        rank 0 alone, so `scale` (the per-rank share other backends report) does not apply."""
        del scale
        both = torch.stack([self.matched, self.counted])
        dist.all_reduce(both)
        if dist.get_rank() != 0 or float(both[1].sum()) == 0:
            return {}
        matched, counted = both
        out = {"router/agreement": float(matched.sum() / counted.sum())}
        for layer, (m, c) in enumerate(zip(matched, counted, strict=True)):
            if c > 0:
                out[f"router/agreement_layer{layer:02d}"] = float(m / c)
        return out

    def _choose(self, layer: int, scores: torch.Tensor, own: torch.Tensor) -> torch.Tensor | None:
        """The indices a router of `layer` uses for `scores` (None: its own)."""
        if self._flat is None:
            return None
        indices, matched, counted = replayed_indices(own, self._flat[:, layer, :].to(own.device))
        self.matched[layer] += float(matched)
        self.counted[layer] += float(counted)
        return indices


class _LayerReplay:
    """What megatron-core's router calls for its top-k (its `RouterReplay` interface)."""

    def __init__(self, owner: MegatronRouteReplay, layer: int) -> None:
        self.owner, self.layer = owner, layer

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None,
        group_topk: int | None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, own = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        chosen = self.owner._choose(self.layer, scores, own)
        if chosen is None:
            return values, own
        return scores.gather(1, chosen), chosen
