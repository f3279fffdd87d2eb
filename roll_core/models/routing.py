"""Mixture-of-experts routing replay (R3): record the experts every token was routed to when
it was sampled, and route the trainer's forward through the same experts.

On an MoE model the sampler and the trainer pick different top-k experts for some tokens
(a last-bit difference in the router logits flips a near tie), so the trainer's log-probs are
not those of the policy that sampled. Routing replay (Ma et al. 2025, "Stabilizing MoE RL by
aligning training and inference routers", arXiv 2510.11370: "R3") records the routed experts
during rollout and replays them in training.

* **Layout.** Routes of one sequence are ``[N, L, K]`` small ints: token, MoE layer (the
  model's routers in module order), the k-th choice (the router's own order). The Batch field
  :data:`ROUTES_KEY` is ``[B, T, L, K]`` aligned with ``input_ids``; :data:`NO_ROUTE` (-1)
  where nothing was recorded (padding, a response's last token, which is never fed back): the
  trainer routes those tokens itself. int8 for up to 128 experts, else int16
  (:func:`routes_dtype`).
* **Recording** (:class:`RouteRecorder`): forward hooks on the routers keep each forward's
  top-k indices; the inference engine maps them to its rows (backends/infer/hf*.py).
* **Replay** (:class:`RouterReplay`): a forward hook on each router replaces its top-k
  indices with the recorded ones and recomputes the gate weights from the router's own
  logits at those experts (softmax, then the router's top-k normalisation), so the gradient
  still reaches the router weights and the load-balancing loss (computed from the logits) is
  unchanged. It also counts how often the trainer's own top-k agreed with the record, per
  layer (:meth:`RouterReplay.metrics`), measured before the replacement.

Departures from the paper: the replayed routes are the sampler's for every token the trainer
recomputes (prompt and response), as the paper; tokens without a record (see above) keep the
trainer's own choice. Only routers whose forward is softmax -> top-k (-> normalise) are
supported (:data:`REPLAY_ROUTERS`); others are a ConfigError.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from roll_core.errors import ConfigError

ROUTES_KEY = "routed_experts"
"""Batch tensor: ``[B, T, L, K]`` routed experts per input token (NO_ROUTE: none)."""
NO_ROUTE = -1

REPLAY_ROUTERS = frozenset(
    {
        "Qwen2MoeTopKRouter",
        "Qwen3MoeTopKRouter",
        "Qwen3VLMoeTextTopKRouter",
        "Qwen3_5MoeTopKRouter",
        "Qwen3NextTopKRouter",
        "MixtralTopKRouter",
        "OlmoeTopKRouter",
    }
)
"""transformers router classes whose forward is ``logits = x W^T; p = softmax(logits); top-k
of p; optionally p_k / sum p_k`` and returns ``(logits, weights, indices)`` (5.19)."""

MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def moe_experts(config: dict[str, Any]) -> int:
    """The number of routed experts a config.json declares (0: a dense model). Looks inside
    ``text_config`` too (vision-language MoE models)."""
    for source in (config, config.get("text_config") or {}):
        for key in MOE_CONFIG_KEYS:
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return 0


def routes_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed dtype that holds every expert id and NO_ROUTE."""
    return torch.int8 if num_experts <= 128 else torch.int16


def routers(model: Any) -> list[Any]:
    """The model's routers, in module order (= layer order); [] for a dense model. A router
    of a class outside REPLAY_ROUTERS is a ConfigError."""
    found = [m for m in model.modules() if type(m).__name__.endswith(("Router", "Gate"))]
    found = [m for m in found if hasattr(m, "top_k") and hasattr(m, "num_experts")]
    unknown = sorted({type(m).__name__ for m in found} - REPLAY_ROUTERS)
    if unknown:
        raise ConfigError(
            f"router replay does not know this model's router ({', '.join(unknown)}): it "
            "replays softmax top-k routers only.",
            hint=f"Set algorithm.router_replay: off, or use a model whose router is one of "
            f"{', '.join(sorted(REPLAY_ROUTERS))}.",
        )
    return found


def _input_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs["inputs_embeds"]
    return int(ids.shape[0]), int(ids.shape[1])


class RouteRecorder:
    """Keeps the top-k indices of every router during :meth:`capture` (inference). Each model
    forward inside it becomes one ``[B, W, L, K]`` tensor (``B, W``: that forward's input
    ids) in :attr:`forwards`, on the CPU, in :func:`routes_dtype`."""

    def __init__(self, model: Any) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ConfigError(
                "router replay needs a mixture-of-experts model; this model has no router.",
                hint="Set algorithm.router_replay: off for dense models.",
            )
        self.dtype = routes_dtype(int(self.routers[0].num_experts))
        self.forwards: list[torch.Tensor] = []
        self._active = False
        self._shape: tuple[int, int] | None = None
        self._layers: list[torch.Tensor | None] = []
        model.register_forward_pre_hook(self._on_model, with_kwargs=True)
        model.register_forward_hook(self._after_model, with_kwargs=True)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _on_model(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._active:
            self._shape = _input_shape(args, kwargs)
            self._layers = [None] * len(self.routers)

    def _hook(self, layer: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            if self._active:
                self._layers[layer] = output[2].detach()

        return hook

    def _after_model(self, _m: Any, _a: Any, _k: Any, _out: Any) -> None:
        if not self._active or self._shape is None:
            return
        if any(x is None for x in self._layers):
            raise RuntimeError("router replay: a forward skipped a router; cannot record")
        stacked = torch.stack(self._layers, dim=1)  # type: ignore[arg-type]  # [B*W, L, K]
        self.forwards.append(stacked.to("cpu", self.dtype).view(*self._shape, *stacked.shape[1:]))
        self._shape, self._layers = None, []

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Record the forwards run inside; yields :attr:`forwards` (emptied first)."""
        self.forwards = []
        self._active = True
        try:
            yield self.forwards
        finally:
            self._active = False


class RouterReplay:
    """Replays recorded routes in a trainer's forwards (see the module docstring).

    :meth:`set` gives the routes of the next forwards (``[B, W, L, K]`` in the layout of the
    model's input, or None: the trainer routes itself). They stay until the next :meth:`set`,
    so a backward that recomputes the forward (gradient checkpointing) replays them too.
    """

    def __init__(self, model: Any, *, replay: bool = True) -> None:
        self.routers = routers(model)
        if not self.routers:
            raise ConfigError(
                "algorithm.router_replay is r3, but the trained model has no mixture-of-"
                "experts router (a dense model routes nothing).",
                hint="Set algorithm.router_replay: off for dense models.",
            )
        self.replay = replay
        self._routes: torch.Tensor | None = None
        # per layer, on the routers' device (no host sync in the forward): choices that agreed,
        # choices recorded
        self.matched: torch.Tensor | None = None
        self.counted: torch.Tensor | None = None
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def set(self, routes: torch.Tensor | None) -> None:
        self._routes = routes

    def reset_metrics(self) -> None:
        self.matched = self.counted = None

    def metrics(self, *, scale: float = 1.0) -> dict[str, float]:
        """``router/agreement`` (all layers) and ``router/agreement_layerNN``: the share of
        recorded (token, choice) pairs the trainer's own top-k chose too, since
        :meth:`reset_metrics`; times `scale` (1 / ranks: their sum is the ranks' mean).
        {} when nothing was recorded."""
        if self.matched is None or self.counted is None or float(self.counted.sum()) == 0:
            return {}
        matched, counted = self.matched.cpu(), self.counted.cpu()
        out = {"router/agreement": float(matched.sum() / counted.sum()) * scale}
        for layer, (m, c) in enumerate(zip(matched, counted, strict=True)):
            if c > 0:
                out[f"router/agreement_layer{layer:02d}"] = float(m / c) * scale
        return out

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, _args: Any, output: Any) -> Any:
            if self._routes is None:
                return None
            logits, weights, own = output
            recorded = self._routes[..., layer, :].reshape(-1, own.shape[-1]).to(own.device)
            indices, matched, counted = replayed_indices(own, recorded)
            if self.matched is None or self.counted is None:
                self.matched = torch.zeros(
                    len(self.routers), dtype=torch.float64, device=own.device
                )
                self.counted = torch.zeros(
                    len(self.routers), dtype=torch.float64, device=own.device
                )
            self.matched[layer] += matched
            self.counted[layer] += counted
            if not self.replay:
                return None
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            gates = probs.gather(-1, indices)
            if getattr(module, "norm_topk_prob", True):
                gates = gates / gates.sum(dim=-1, keepdim=True)
            return logits, gates.to(weights.dtype), indices.to(own.dtype)

        return hook


def replayed_indices(
    own: torch.Tensor, recorded: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A router's top-k under replay: ``(indices, matched, counted)`` for `own` (``[N, K]``,
    the router's choice) and `recorded` (``[N, K]``, NO_ROUTE rows: no record): the recorded
    experts of every token that has a record, `own` elsewhere; the (token, choice) pairs of
    the record the router's own top-k chose too, and the pairs recorded (both tensors, on
    the router's device: no host sync in the forward)."""
    if recorded.shape[0] != own.shape[0]:
        raise RuntimeError(
            f"router replay: {recorded.shape[0]} recorded tokens for a forward of {own.shape[0]}"
        )
    recorded = recorded.long()
    known = recorded[:, 0] != NO_ROUTE
    with torch.no_grad():
        # NO_ROUTE never equals an expert id: unrecorded tokens match nothing
        same = (own.unsqueeze(-1) == recorded.unsqueeze(-2)).any(-1)
        matched, counted = same.sum(), known.sum() * own.shape[-1]
    return torch.where(known[:, None], recorded, own), matched, counted


def extend_routes(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """Routes of a sequence that a later call continued (partial rollout, the next turn of a
    conversation): `old` covers its first tokens, `new` (the later call's) covers them again
    (recomputed as its prompt) and more. The first record of each token wins: the routes under
    which the earlier tokens were sampled; `new` adds only the tokens past `old`."""
    if new is None or (old is not None and len(new) <= len(old)):
        return old
    if old is None:
        return new
    return torch.cat([old, new[len(old) :]])


def routes_tensor(
    routes: list[torch.Tensor | None], lengths: list[int], width: int
) -> torch.Tensor | None:
    """The Batch's ``[B, width, L, K]`` field (:data:`ROUTES_KEY`) from each row's ``[N, L, K]``
    routes of its first N tokens (None: none recorded), NO_ROUTE elsewhere; None when no row
    has any. `lengths`: each row's tokens (routes past it are cut)."""
    first = next((r for r in routes if r is not None), None)
    if first is None:
        return None
    out = torch.full((len(routes), width, *first.shape[1:]), NO_ROUTE, dtype=first.dtype)
    for i, (r, n) in enumerate(zip(routes, lengths, strict=True)):
        if r is not None:
            n = min(n, len(r), width)
            out[i, :n] = r[:n]
    return out


def packed_routes(routes: torch.Tensor, pack: Any) -> torch.Tensor:
    """``[B, T, L, K]`` routes in a packed layout (`pack`: PackedRows.pack, which fills with
    zeros): NO_ROUTE on the filler."""
    return pack(routes.long() - NO_ROUTE) + NO_ROUTE


def router_replay_for(model: Any, mode: str) -> RouterReplay | None:
    """The replay hooks of `algorithm.router_replay` `mode` on `model`: None for ``off``."""
    if mode == "off":
        return None
    if mode != "r3":
        raise ConfigError(
            f"algorithm.router_replay: unknown mode {mode!r}; valid: off, r3.",
            hint="Set algorithm.router_replay to off or r3.",
        )
    return RouterReplay(model)


__all__ = [
    "NO_ROUTE",
    "REPLAY_ROUTERS",
    "ROUTES_KEY",
    "extend_routes",
    "replayed_indices",
    "routes_tensor",
    "RouteRecorder",
    "RouterReplay",
    "moe_experts",
    "packed_routes",
    "router_replay_for",
    "routers",
    "routes_dtype",
]
