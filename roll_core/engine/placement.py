"""Placement of roles on GPUs and a per-GPU memory estimate (pure: no Ray, no devices).

A role asks for `world_size` ranks of `gpus_per_worker` GPUs each, on the GPU ids of its
`device_mapping` (global ids: node k holds ids k*gpus_per_node .. (k+1)*gpus_per_node-1).
Rank r takes mapping[r*G:(r+1)*G]; a rank's GPUs must share a node. Roles whose mappings
overlap are *colocated* (they take turns on those GPUs: offload between phases), disjoint
ones are *disaggregated*. `place` rejects impossible plans with a ConfigError that names the
role and what to change.

The memory estimate (`train_memory`, `infer_memory`, `gpu_memory`) counts parameters,
gradients, optimizer state and KV cache per GPU; activations are not counted (they depend
on micro-batch size, sequence length and gradient checkpointing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from roll_core.engine.model_sizes import ModelShape
from roll_core.errors import ConfigError

GIB = 1024**3


@dataclass(frozen=True)
class RoleRequest:
    """What one role asks for."""

    name: str
    world_size: int
    gpus_per_worker: int = 1
    device_mapping: tuple[int, ...] | None = None
    """None: GPUs 0 .. world_size*gpus_per_worker-1 (colocated with the other roles)."""


@dataclass(frozen=True)
class RolePlacement:
    name: str
    ranks: tuple[tuple[int, ...], ...]
    """GPU ids of each rank."""

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(sorted({g for rank in self.ranks for g in rank}))


@dataclass(frozen=True)
class Placement:
    roles: dict[str, RolePlacement]
    num_gpus: int
    gpus_per_node: int

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    def roles_on(self, gpu: int) -> list[str]:
        return [name for name, role in self.roles.items() if gpu in role.gpus]

    def colocated(self) -> list[tuple[str, str]]:
        """Pairs of roles that share at least one GPU."""
        names = list(self.roles)
        return [
            (a, b)
            for i, a in enumerate(names)
            for b in names[i + 1 :]
            if set(self.roles[a].gpus) & set(self.roles[b].gpus)
        ]

    def node_lines(self) -> list[str]:
        """One line per node: which ranks of which roles sit on its GPUs."""
        lines = []
        for node in range(self.num_nodes):
            ids = range(
                node * self.gpus_per_node, min((node + 1) * self.gpus_per_node, self.num_gpus)
            )
            parts = []
            for name, role in self.roles.items():
                ranks = [r for r, gpus in enumerate(role.ranks) if gpus[0] in ids]
                if ranks:
                    gpus = sorted({g for r in ranks for g in role.ranks[r]})
                    parts.append(f"{name} ranks {span(ranks)} on GPUs {span(gpus)}")
            idle = [g for g in ids if not self.roles_on(g)]
            if idle:
                parts.append(f"idle GPUs {span(idle)}")
            lines.append(f"node {node} (GPUs {span(list(ids))}): " + "; ".join(parts))
        return lines


def span(ids: Sequence[int]) -> str:
    """`0-3,6` for [0, 1, 2, 3, 6]."""
    out: list[str] = []
    ids = sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def place(
    requests: Sequence[RoleRequest], *, num_gpus: int | None = None, gpus_per_node: int = 8
) -> Placement:
    """GPU ids of every rank of every role; ConfigError for a plan that cannot run."""
    roles: dict[str, RolePlacement] = {}
    defaulted: dict[str, bool] = {}
    used_max = -1
    for req in requests:
        need = req.world_size * req.gpus_per_worker
        if req.gpus_per_worker > gpus_per_node:
            raise ConfigError(
                f"{req.name}: num_gpus_per_worker={req.gpus_per_worker} is more than a node "
                f"has (executor.gpus_per_node={gpus_per_node}); one rank cannot span nodes.",
                hint="Lower num_gpus_per_worker (tensor parallel size) or raise gpus_per_node.",
            )
        mapping = tuple(range(need)) if req.device_mapping is None else tuple(req.device_mapping)
        if any(g < 0 for g in mapping) or len(set(mapping)) != len(mapping):
            raise ConfigError(
                f"{req.name}.device_mapping {list(mapping)} has negative or repeated GPU ids.",
                hint="List each GPU id once, e.g. [0, 1, 2, 3].",
            )
        if len(mapping) % req.gpus_per_worker:
            raise ConfigError(
                f"{req.name}: num_gpus_per_worker={req.gpus_per_worker} (tensor parallel size) "
                f"does not divide its device_mapping of {len(mapping)} GPUs.",
                hint=f"Use a mapping whose length is a multiple of {req.gpus_per_worker}.",
            )
        if need > len(mapping):
            raise ConfigError(
                f"{req.name} needs world_size {req.world_size} x num_gpus_per_worker "
                f"{req.gpus_per_worker} = {need} GPUs but its device_mapping lists "
                f"{len(mapping)}.",
                hint=f"Set {req.name}.world_size to {len(mapping) // req.gpus_per_worker} or "
                "list more GPUs in device_mapping.",
            )
        if need < len(mapping):
            raise ConfigError(
                f"{req.name}: world_size {req.world_size} x num_gpus_per_worker "
                f"{req.gpus_per_worker} uses {need} of the {len(mapping)} GPUs of its "
                "device_mapping.",
                hint=f"Set {req.name}.world_size to {len(mapping) // req.gpus_per_worker}, or "
                "shorten device_mapping.",
            )
        g = req.gpus_per_worker
        ranks = tuple(mapping[r * g : (r + 1) * g] for r in range(req.world_size))
        for r, gpus in enumerate(ranks):
            if len({x // gpus_per_node for x in gpus}) > 1:
                raise ConfigError(
                    f"{req.name} rank {r} spans nodes (GPUs {list(gpus)}, {gpus_per_node} per "
                    "node); the GPUs of one rank must share a node.",
                    hint="Order device_mapping so every group of num_gpus_per_worker ids is "
                    "on one node.",
                )
        roles[req.name] = RolePlacement(req.name, ranks)
        defaulted[req.name] = req.device_mapping is None
        used_max = max(used_max, *mapping)
    total = used_max + 1 if num_gpus is None else num_gpus
    for role in roles.values():
        over = [x for x in role.gpus if x >= total]
        if over:
            what = (
                f"{role.name} (no device_mapping: {len(role.gpus)} GPUs from GPU 0)"
                if defaulted[role.name]
                else f"{role.name}.device_mapping"
            )
            raise ConfigError(
                f"{what} uses GPU {over[-1]} but the cluster has {total} "
                f"GPUs (ids 0-{total - 1}, executor.num_gpus).",
                hint="Use GPU ids below executor.num_gpus, or raise executor.num_gpus if the "
                "cluster is bigger.",
            )
    return Placement(roles, total, gpus_per_node)


# ---- memory -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainMemorySpec:
    backend: str  # torch | fsdp2 | deepspeed | megatron
    world_size: int
    param_bytes: int = 4  # model.dtype: 4 float32, 2 bfloat16
    zero_stage: int = 0  # deepspeed only
    offload_optimizer: bool = False
    offload_param: bool = False
    cpu_offload: bool = False  # fsdp2: params, grads and optimizer state on the CPU
    lora: bool = False
    tp: int = 1  # megatron: tensor, pipeline and expert parallel sizes
    pp: int = 1
    ep: int = 1


def train_memory(shape: ModelShape, spec: TrainMemorySpec) -> dict[str, float]:
    """Bytes per GPU of one train rank: params, grads, optimizer (AdamW: two fp32 moments,
    plus an fp32 master copy when the parameters are lower precision).

    Sharding over world_size N: fsdp2 shards all three; ZeRO-1 the optimizer, ZeRO-2 also
    grads, ZeRO-3 also params; torch shards nothing; megatron splits params and grads over
    tp x pp (experts also over ep) and the optimizer over all N (distributed optimizer). LoRA trains ~no parameters (gradient and
    optimizer state of the adapters is neglected)."""
    n = shape.params
    params = float(n * spec.param_bytes)
    grads = 0.0 if spec.lora else float(n * spec.param_bytes)
    optim = 0.0 if spec.lora else float(n * (8 + (4 if spec.param_bytes < 4 else 0)))
    w = spec.world_size
    if spec.backend == "fsdp2":
        params, grads, optim = params / w, grads / w, optim / w
        if spec.cpu_offload:
            params = grads = optim = 0.0
    elif spec.backend == "deepspeed":
        if spec.zero_stage >= 1:
            optim /= w
        if spec.zero_stage >= 2:
            grads /= w
        if spec.zero_stage >= 3:
            params /= w
        if spec.offload_optimizer:
            optim = 0.0
        if spec.offload_param:
            params = 0.0
    elif spec.backend == "megatron":
        # dense weights split over tp x pp, each expert over tp x pp and the experts over ep;
        # the distributed optimizer shards the AdamW state over every rank
        experts = shape.num_layers * shape.num_experts * 3 * shape.hidden_size
        experts *= shape.moe_intermediate_size
        share = ((n - experts) + experts / spec.ep) / (n * spec.tp * spec.pp)
        params, grads, optim = params * share, grads * share, optim / w
    return {"params": params, "grads": grads, "optimizer": optim}


@dataclass(frozen=True)
class LogitsSpec:
    """What sizes the logits one micro-batch of the RL objective materialises."""

    micro_batch_size: int  # rows per forward (trainer.micro_batch_size)
    seq_len: int  # longest row: prompt + response tokens
    response_len: int  # longest response: the positions the loss reads
    logits_bytes: int = 2  # 2: 16-bit weights or bf16 autocast; 4: fp32 throughout
    # actor_train.max_tokens_per_micro_batch: a micro-batch holds at most this many positions
    # (as many rows as fit, micro_batch_size unused), all of which may be response tokens
    max_tokens: int | None = None
    # actor_train.logit_chunk_tokens: positions whose logits exist at a time (None: about
    # AUTO_CHUNK_ELEMENTS logits; 0: the micro-batch's at once)
    chunk_tokens: int | None = None

    def positions(self) -> int:
        """B x L: the positions of one micro-batch (the budget when there is one)."""
        return self.max_tokens or self.micro_batch_size * self.seq_len

    def response_positions(self) -> int:
        """N = B x R: the response positions the loss reads (at most the budget)."""
        return self.max_tokens or self.micro_batch_size * self.response_len


LOGIT_CHUNK = 2**26
"""Logit elements the trainer turns into float32 at a time when the logits exist whole
(backends/train/lm_head.py: LOG_PROB_CHUNK; the engine layer cannot import the backends,
tests check they agree)."""

AUTO_CHUNK_ELEMENTS = 2**24
"""lm_head.py's AUTO_CHUNK_ELEMENTS: `logit_chunk_tokens: null` puts about this many logits in
a chunk."""


def chunk_positions(vocab_size: int, chunk_tokens: int | None) -> int:
    """Positions of one chunk of the output layer: `logit_chunk_tokens`, or for null
    AUTO_CHUNK_ELEMENTS // vocabulary; 0 for none (the whole micro-batch at once)."""
    if chunk_tokens is None:
        return max(1, AUTO_CHUNK_ELEMENTS // max(1, vocab_size))
    return chunk_tokens


def logits_memory(shape: ModelShape, spec: LogitsSpec) -> float:
    """Peak bytes of one micro-batch's logits in actor_train (train phase only), as the code
    computes them, with B rows of L positions, R of them response tokens, vocabulary V,
    b bytes per logit (w = 4 more when b = 2: the float32 copy) and C = LOGIT_CHUNK.

    Chunked (`logit_chunk_tokens` c > 0 or null, c below the micro-batch's positions;
    backends/train/lm_head.py): the forward stops at the hidden states and the output layer runs on c positions at a time, E = c V
    logits, recomputed in the backward; the larger of
    * log-prob pass: the chunk's logits, their float32 copy divided by the temperature and
      its log-softmax: E (b + w + 8);
    * loss pass: the chunk's logits, scaled copy, log-softmax and the entropy metric's
      softmax and product in the forward, E (b + w + 16); in the backward the recomputed
      log-softmax, its gradient and the logits' (E (b + w + 12)).
    Measured (benchmarks/lm_head_memory.py, V = 151,936, bf16 on CPU): see docs/performance.md.

    Whole (`logit_chunk_tokens: 0`, or a micro-batch within one chunk), the larger
    of its two passes:
    * log-prob pass (old / reference log-probs): the logits [B, L, V] plus one chunk of at
      most C of them in float32, divided by the temperature, and its log-softmax:
      B L V b + 8 min(C, B L V);
    * loss pass (`workers/objectives.py:rl`), with N = B R response rows: the largest of
      taking the rows out beside the logits (a b-byte copy, its float32 copy when b = 2, and
      that divided by the temperature: B L V b + N V (b + 4 + w)), the entropy metric
      beside the float32 rows and their log-softmax (B L V b + 8 N V + 8 min(C, N V)), and
      backward (the saved log-softmax, its gradient and the input's: 12 N V; the logits are
      gone by then).
    Measured on CPU (peak RSS, V = 151,936, B 1, L 1024, R 768, bf16): log-prob pass 817 MiB
    (formula 809), loss pass 1711 MiB (formula 1699). The torch backend computes the logits
    of the response columns only (so L is ~R there); the estimate keeps L, the sharded
    backends' case. An entropy bonus (algorithm.entropy_coef > 0) keeps two more float32
    [N, V] tensors for backward, not counted; nor are the other activations.
    """
    v, b = shape.vocab_size, spec.logits_bytes
    w = 4 if b < 4 else 0
    chunk = chunk_positions(v, spec.chunk_tokens)
    if 0 < chunk < spec.positions():
        log_prob_elems = min(chunk, spec.positions()) * v
        loss_elems = min(chunk, spec.response_positions()) * v
        return float(max(log_prob_elems * (b + w + 8), loss_elems * (b + w + 16)))
    full = spec.positions() * v
    picked = spec.response_positions() * v
    log_prob_pass = full * b + 8 * min(LOGIT_CHUNK, full)
    take_rows = full * b + picked * (b + 4 + w)
    entropy = full * b + 8 * picked + 8 * min(LOGIT_CHUNK, picked)
    backward = 12 * picked
    return float(max(log_prob_pass, take_rows, entropy, backward))


def checkpointed_activations(shape: ModelShape, spec: LogitsSpec) -> float:
    """Bytes of the layer inputs gradient checkpointing keeps for backward over one
    micro-batch: num_layers x B x L x hidden_size x b (b: the compute dtype's bytes, as for
    the logits). The one layer recomputed at a time during backward is not counted."""
    return float(shape.num_layers * spec.positions() * shape.hidden_size * spec.logits_bytes)


def infer_memory(
    shape: ModelShape, *, tensor_parallel: int, dtype_bytes: int, kv_tokens: int
) -> dict[str, float]:
    """Bytes per GPU of one inference engine over `tensor_parallel` GPUs: its weights and the
    KV cache of `kv_tokens` tokens in flight (both split over the TP group)."""
    return {
        "params": float(shape.params * dtype_bytes) / tensor_parallel,
        "kv_cache": float(shape.kv_bytes_per_token(dtype_bytes) * kv_tokens) / tensor_parallel,
    }


@dataclass
class GpuMemory:
    """Estimated memory of one GPU: per role, per component (bytes)."""

    gpu: int
    roles: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def resident(self) -> float:
        """Every role on this GPU loaded at once."""
        return sum(sum(parts.values()) for parts in self.roles.values())

    @property
    def peak_taking_turns(self) -> float:
        """Colocated roles offloaded between phases: the largest role alone."""
        return max((sum(parts.values()) for parts in self.roles.values()), default=0.0)


def gpu_memory(placement: Placement, per_role: dict[str, dict[str, float]]) -> list[GpuMemory]:
    """Per-GPU estimate from each role's per-rank estimate (roles without one are skipped)."""
    out = []
    for gpu in range(placement.num_gpus):
        mem = GpuMemory(gpu)
        for name in placement.roles_on(gpu):
            if name in per_role:
                mem.roles[name] = per_role[name]
        out.append(mem)
    return out


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"
