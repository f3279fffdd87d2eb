"""The `megatron` train backend: megatron-core's GPTModel with tensor (TP, optionally sequence
parallel), pipeline (PP, optionally virtual stages), expert (EP) and data parallelism.

One instance per rank; the cluster has started the torch.distributed group (gloo on CPU, nccl
on GPU). The model is built from the Hugging Face config and loaded from the HF weights
through roll_core/convert's mapping (megatron_model.py); megatron-core's DDP and distributed
optimizer hold the gradients and AdamW state; micro-batches run through megatron's pipeline
schedule (`get_forward_backward_func`). On a machine without CUDA, megatron_shims.py patches
the few CUDA-only spots first.

Data: the driver splits the global batch over all ranks (as for fsdp2). The ranks of one
data-parallel replica (its TP x PP ranks) gather their shards, so the replica trains on their
union; the objective normalises with the global counts in `batch.meta` and each micro-batch's
loss is its share of the global loss, so megatron sums (`calculate_per_token_loss`: no
division by micro-batches or data-parallel size) and the update is that of one big batch.
Every rank runs the same number of micro-batches of the same shape (the pipeline's p2p
buffers and the expert all-to-alls need it): rows and columns are padded and padding is cut
off before the objective sees the logits; replicas with fewer micro-batches run dummies
(loss times zero). Each replica reports its metrics once (from its TP rank 0, first stage).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from roll_core.backends.train import check_backend_installed
from roll_core.backends.train.base import TrainBackendSpec, add_metrics
from roll_core.backends.train.lm_head import LMHead, log_probs_and_entropy, target_log_probs
from roll_core.backends.train.megatron_model import (
    Layout,
    ShardMap,
    build_chunks,
    check_layout,
    iter_hf_tensors,
    keep_padding_row_frozen,
    load_hf_weights,
    read_dims,
    transformer_config,
)
from roll_core.backends.train.megatron_routing import MegatronRouteReplay, recompute_error
from roll_core.backends.train.schedules import lr_multiplier
from roll_core.backends.train.sharded import (
    digest,
    rank_device,
    require_process_group,
    rng_state,
    seed_everything,
    set_rng_state,
)
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.config.schema import MegatronConfig, OptimConfig
from roll_core.convert.roll_megatron import RANK_FILE
from roll_core.data import Batch
from roll_core.errors import CheckpointError, ConfigError
from roll_core.models.routing import ROUTES_KEY

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LRSchedule:
    """Warmup + decay (schedules.lr_multiplier) over megatron's optimizer param groups, with
    the state_dict / get_last_lr interface of a torch LR scheduler (ActorTrain's `lr=`
    override saves and restores it)."""

    def __init__(self, optimizer: Any, optim: OptimConfig, total_steps: int) -> None:
        self.optimizer, self.optim, self.total_steps = optimizer, optim, total_steps
        self.last_epoch = 0
        self._apply()

    def _lr(self) -> float:
        o = self.optim
        return o.lr * lr_multiplier(
            self.last_epoch,
            warmup_steps=o.warmup_steps,
            total_steps=self.total_steps,
            kind=o.scheduler,
            min_ratio=o.min_lr_ratio,
        )

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [self._lr() for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._apply()


class MegatronTrainBackend(TorchTrainBackend):
    """TrainBackend over megatron-core, one instance per rank."""

    name = "megatron"
    checkpoint_layout = "shared"
    """`save(path)` gets one directory every rank writes its own files into."""

    def __init__(self, spec: TrainBackendSpec) -> None:
        """Built from the typed spec like every train backend. Rows are right-padded per
        micro-batch (megatron's schedule takes fixed-shape micro-batches): a token budget
        cannot take effect here and is refused; `packing` does not apply."""
        if spec.max_tokens_per_micro_batch is not None:
            raise ConfigError(
                "actor_train.max_tokens_per_micro_batch is not supported by the megatron "
                "backend (its pipeline schedule takes micro-batches of micro_batch_size rows).",
                hint="Remove actor_train.max_tokens_per_micro_batch and set "
                "trainer.micro_batch_size, or use actor_train.backend: torch / fsdp2 / "
                "deepspeed.",
            )
        self._build(
            model_path=spec.model_path,
            tokenizer_path=spec.tokenizer_path,
            dtype=spec.dtype,
            device=spec.device,
            precision=spec.precision,
            optim=spec.optim,
            total_steps=spec.total_steps,
            micro_batch_size=spec.micro_batch_size,
            seed=spec.seed,
            num_threads=spec.num_threads,
            gradient_checkpointing=spec.gradient_checkpointing,
            lora=spec.lora,
            megatron=spec.megatron,
            frozen=spec.frozen,
            router_replay=spec.router_replay,
            logit_chunk_tokens=spec.logit_chunk_tokens,
        )

    def _build(
        self,
        *,
        model_path: str,
        tokenizer_path: str | None = None,
        dtype: str = "float32",
        device: str = "auto",
        precision: str = "auto",
        optim: OptimConfig,
        total_steps: int,
        micro_batch_size: int,
        seed: int = 0,
        num_threads: int | None = None,
        gradient_checkpointing: bool = False,
        lora: Any = None,
        megatron: MegatronConfig | None = None,
        frozen: bool = False,
        router_replay: str = "off",
        logit_chunk_tokens: int | None = None,
    ) -> None:
        """``frozen``: log-prob passes only (the reference role): the chunks are not wrapped in
        megatron's DDP and get no optimizer or schedule; `log_probs` is all it serves.
        ``logit_chunk_tokens``: positions of the output layer computed at a time
        (:func:`deferred_output`)."""
        if lora is not None:
            raise ConfigError(
                "actor_train.lora is not supported with the megatron backend.",
                hint="Use actor_train.backend=torch for LoRA.",
            )
        opts = megatron or MegatronConfig()
        check_backend_installed("megatron")  # checked before the run too (roles.py)
        self.rank, self.world_size = require_process_group(self.name)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        seed_everything(seed)
        self.device = rank_device(device)
        if self.device.type == "cpu":
            from roll_core.backends.train.megatron_shims import apply_cpu_shims

            apply_cpu_shims()
        self.autocast_dtype = None
        self.micro_batch_size = micro_batch_size
        self.logit_chunk_tokens = logit_chunk_tokens
        self._init_processors(model_path, tokenizer_path)
        self.lora = None
        self.model_path = model_path
        self.optim_cfg = optim
        self.layout = self._init_parallel(opts)
        params_dtype = torch.bfloat16 if precision == "bf16" else _DTYPES[dtype]
        if precision == "auto" and self.device.type == "cuda":
            params_dtype = torch.bfloat16
        self.dims, self.hf_config = read_dims(model_path, self.layout.tp)
        self._check_layout()
        self.config = transformer_config(
            self.dims, self.layout, params_dtype, cpu=self.device.type == "cpu"
        )
        recompute = gradient_checkpointing and not frozen  # no backward: nothing to recompute
        self.config.recompute_granularity = "full" if recompute else None
        if recompute:
            self.config.recompute_method, self.config.recompute_num_layers = "uniform", 1
        chunks = build_chunks(self.dims, self.config, self.layout)
        if self.device.type == "cuda":
            chunks = [c.to(self.device) for c in chunks]
        self.shards = ShardMap(self.dims, chunks)
        load_hf_weights(model_path, self.shards)
        self.route_replay = self._route_replay(router_replay, chunks, recompute=recompute)
        # what ActorTrain reads the agreement metrics from, as on the other backends
        self.router_replay = self.route_replay  # type: ignore[assignment]
        if frozen:
            for chunk in chunks:
                chunk.requires_grad_(False)
            self.chunks = chunks
            self.model = torch.nn.ModuleList(chunks)  # type: ignore[assignment]
            self.optimizer = self.scheduler = None  # type: ignore[assignment]
            return
        keep_padding_row_frozen(chunks, self.hf_config.get("pad_token_id"))
        self._wrap(chunks, optim, total_steps, params_dtype)

    # ---- setup ------------------------------------------------------------------------------
    def _route_replay(
        self, mode: str, chunks: list[Any], *, recompute: bool
    ) -> MegatronRouteReplay | None:
        """`algorithm.router_replay` on megatron's routers (backends/train/megatron_routing.py);
        None for ``off``."""
        if mode == "off":
            return None
        if recompute:
            raise recompute_error()
        return MegatronRouteReplay(
            chunks, num_layers=self.dims.num_layers, tp=self.layout.tp, sp=self.layout.sp
        )

    def _init_parallel(self, opts: MegatronConfig) -> Layout:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if self.world_size % (opts.tp * opts.pp) or (self.world_size // opts.pp) % (
            opts.tp * opts.ep
        ):
            raise ConfigError(
                f"actor_train.world_size={self.world_size} does not split into tp={opts.tp} x "
                f"pp={opts.pp} x ep={opts.ep} (x data parallel).",
                hint="Make world_size a multiple of tp * pp * ep.",
            )
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=opts.tp,
            pipeline_model_parallel_size=opts.pp,
            virtual_pipeline_model_parallel_size=opts.vpp,
            expert_model_parallel_size=opts.ep,
        )
        model_parallel_cuda_manual_seed(0)
        dp = self.world_size // (opts.tp * opts.pp)
        return Layout(tp=opts.tp, pp=opts.pp, ep=opts.ep, vpp=opts.vpp, sp=opts.sp, dp=dp)

    def _check_layout(self) -> None:
        check_layout(self.dims, self.layout)

    def _wrap(
        self, chunks: list[Any], optim: OptimConfig, total_steps: int, dtype: torch.dtype
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.distributed import DistributedDataParallelConfig as DDPConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DDPConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        wrapped = []
        for i, chunk in enumerate(chunks):
            wrapped.append(
                DistributedDataParallel(
                    config=self.config,
                    ddp_config=ddp_config,
                    module=chunk,
                    disable_bucketing=i > 0,
                )
            )
        self.chunks = wrapped
        self.model = torch.nn.ModuleList(wrapped)  # type: ignore[assignment]
        # the objectives' losses are shares of the global loss: never divide by token counts
        self.config.finalize_model_grads_func = functools.partial(_finalize, finalize_model_grads)
        no_sync = [c.no_sync for c in wrapped]
        self.config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        self.config.grad_scale_func = None
        max_norm = optim.max_grad_norm
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0],
            adam_beta2=optim.betas[1],
            adam_eps=optim.eps,
            clip_grad=float(max_norm) if max_norm is not None else 0.0,
            use_distributed_optimizer=True,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
        )
        # config_overrides={}: weight decay on every parameter, as roll's other backends
        self.optimizer = get_megatron_optimizer(opt_config, wrapped, config_overrides={})
        self.scheduler = LRSchedule(self.optimizer, optim, total_steps)  # type: ignore[assignment]

    # ---- data: this replica's rows, in lock-step micro-batches ------------------------------
    def _replica_batch(self, batch: Batch) -> Batch:
        """The union of the shards of this data-parallel replica's ranks (its TP x PP group),
        in rank order."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return batch
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, batch, group=group)
        return Batch.concat([p for p in parts if len(p)])

    def _max_over_ranks(self, *values: int) -> list[int]:
        t = torch.tensor(values, dtype=torch.long)
        if dist.get_backend() == "nccl":
            t = t.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def _plan(self, data: Batch) -> tuple[list[tuple[Batch, bool]], int]:
        """(micro-batch, is_dummy) list, the same length on every rank, and the padded width
        every micro-batch is run at (a multiple of tp under sequence parallelism)."""
        chunks = data.chunk(self.micro_batch_size) if len(data) else []
        width = data.tensors["input_ids"].shape[1] if len(data) else 1
        n, width = self._max_over_ranks(len(chunks), width)
        if n and not chunks:
            raise RuntimeError("a data-parallel replica got no rows: fewer rows than replicas")
        if self.layout.vpp:  # the interleaved schedule runs micro-batches in groups of pp
            n = -(-n // self.layout.pp) * self.layout.pp
        if self.layout.sp:
            width = -(-width // self.layout.tp) * self.layout.tp
        return [(c, False) for c in chunks] + [(chunks[-1], True)] * (n - len(chunks)), width

    def _inputs(self, mb: Batch, width: int) -> tuple[torch.Tensor, ...]:
        """(input_ids, position_ids, attention_mask) padded to micro_batch_size x width. The
        mask is causal and hides padded keys (True = masked, megatron's convention); positions
        are 0..width-1 on every row, as the HF model computes them without position_ids."""
        ids = mb.tensors["input_ids"]
        attn = mb.tensors["attention_mask"]
        rows, cols = ids.shape
        pad_rows, pad_cols = self.micro_batch_size - rows, width - cols
        ids = F.pad(ids, (0, pad_cols, 0, pad_rows), value=0)
        attn = F.pad(attn, (0, pad_cols, 0, pad_rows), value=0)
        causal = torch.ones(width, width, dtype=torch.bool).triu(1)
        mask = causal[None, None] | (attn[:, None, None, :] == 0)
        pos = torch.arange(width).expand(self.micro_batch_size, width)
        return (
            ids.to(self.device),
            pos.to(self.device),
            mask.to(self.device),
        )

    def _run(
        self, data: Batch, on_head: Any, *, forward_only: bool
    ) -> tuple[list[tuple[Batch, bool]], Any]:
        """Every micro-batch of ``data`` through megatron's schedule. ``on_head(head, mb, dummy)
        -> loss`` runs on the last stage with the micro-batch's :class:`LMHead` over its real
        positions [rows, T] (padding cut off): the output layer applied a chunk of positions at
        a time (:func:`deferred_output`), or the forward's logits with ``logit_chunk_tokens:
        0``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        plan, width = self._plan(data)
        layer = self._output_layer() if self.logit_chunk_tokens != 0 else None
        deferred: dict[str, Any] = {}

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            mb, dummy = next(data_iterator)
            ids, pos, mask = self._inputs(mb, width)
            if self.route_replay is not None:  # MoE routing replay: this micro-batch's routes
                routes = mb.tensors.get(ROUTES_KEY)
                self.route_replay.set(routes, rows=self.micro_batch_size, width=width)
            out = model(ids, pos, mask)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                rows, cols = mb.tensors["input_ids"].shape
                loss = on_head(self._head(output[:rows, :cols], deferred), mb, dummy)
                return loss, torch.ones((), dtype=torch.int), {}

            return out, loss_func

        n_chunks = len(self.chunks)
        iterators = [iter(plan) for _ in range(n_chunks)]
        schedule = get_forward_backward_func()
        with deferred_output(layer, deferred) if layer is not None else contextlib.nullcontext():
            schedule(
                forward_step_func=forward_step,
                data_iterator=iterators if n_chunks > 1 else iterators[0],
                model=self.chunks if n_chunks > 1 else self.chunks[0],
                num_microbatches=len(plan),
                seq_length=width,
                micro_batch_size=self.micro_batch_size,
                forward_only=forward_only,
            )
        return plan, width

    def _output_layer(self) -> Any:
        """The output layer of this rank's last model chunk, if it holds the last stage."""
        model = self.chunks[-1]
        model = getattr(model, "module", model)  # megatron's DDP wraps the GPTModel
        return getattr(model, "output_layer", None) if model.post_process else None

    def _head(self, output: torch.Tensor, deferred: dict[str, Any]) -> LMHead:
        """The micro-batch's head: `output` is the last hidden states [rows, T, H] of a
        deferred output layer (its weight in `deferred`), else the logits."""
        vocab = self.dims.vocab_size
        weight = deferred.get("weight")
        if weight is None:
            return LMHead.from_logits(output[..., :vocab])
        group = deferred["group"]

        def project(rows: torch.Tensor) -> torch.Tensor:
            """[n, H] -> [n, V]: this rank's vocabulary shard, gathered over the TP ranks
            (the gather's backward hands each rank its shard's gradient)."""
            from megatron.core.tensor_parallel.mappings import (
                gather_from_tensor_model_parallel_region,
            )

            shard = F.linear(rows.to(weight.dtype), weight)
            return gather_from_tensor_model_parallel_region(shard, group)[:, :vocab]

        return LMHead(output, project, vocab_size=vocab, chunk_tokens=self.logit_chunk_tokens)

    # ---- the step ---------------------------------------------------------------------------
    def _is_reporter(self) -> bool:
        """One rank per data-parallel replica reports its metrics: TP rank 0 of stage 0."""
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_first_stage(
            ignore_virtual=True
        )

    def _from_last_stage(self, value: Any) -> Any:
        """``value`` of the last pipeline stage, on every stage of this pipeline."""
        from megatron.core import parallel_state as ps

        if self.layout.pp == 1:
            return value
        box = [value]
        group = ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, self.layout.pp - 1)
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def train_step(self, batch: Batch, objective: Any) -> dict[str, float]:
        start = time.perf_counter()
        data = self._replica_batch(batch)
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums: dict[str, float] = {}
        logits_from = getattr(objective, "logits_from", None)

        def on_head(head: LMHead, mb: Batch, dummy: bool) -> torch.Tensor:
            first = logits_from(mb) if logits_from is not None else 0
            loss, metrics = objective(head.from_column(first), mb.to(self.device))
            if not dummy:
                add_metrics(sums, metrics)
            return loss * (0.0 if dummy else 1.0)

        self._run(data, on_head, forward_only=False)
        lr = float(self.optimizer.param_groups[0]["lr"])
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step()
        sums = self._from_last_stage(sums)
        if not self._is_reporter():
            return {}
        return {
            **sums,
            "train/grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
            "train/lr": lr,
            "perf/tokens": float(data.tensors["attention_mask"].sum()),
            "perf/train_s": time.perf_counter() - start,
        }

    @torch.no_grad()
    def evaluate(self, batch: Batch, objective: Any) -> dict[str, float]:
        data = self._replica_batch(batch)
        for chunk in self.chunks:
            chunk.eval()
        sums: dict[str, float] = {}

        def on_head(head: LMHead, mb: Batch, dummy: bool) -> torch.Tensor:
            _, metrics = objective(head, mb.to(self.device))
            if not dummy:
                add_metrics(sums, metrics)
            return head.hidden.new_zeros(())

        self._run(data, on_head, forward_only=True)
        sums = self._from_last_stage(sums)
        return sums if self._is_reporter() else {}

    def token_stats(self, batch: Batch, *, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """The rollout record's per-token values: ``log_probs`` (as :meth:`log_probs`) and the
        ``entropy`` of every next-token distribution, [B, T-1] float32 each."""
        return self._token_pass(batch, log_probs_and_entropy, temperature, ("log_probs", "entropy"))

    def log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        """[B, T-1] for this rank's own rows (its replica computes its ranks' rows together)."""
        return self._token_pass(batch, _log_probs_only, temperature, ("log_probs",))["log_probs"]

    @torch.no_grad()
    def _token_pass(
        self, batch: Batch, fn: Any, temperature: float, keys: tuple[str, ...]
    ) -> dict[str, torch.Tensor]:
        """``fn(head, input_ids, valid, temperature=)`` -> one [rows, T-1] tensor per key, for
        this rank's own rows; 0 where a row has no next token (padding), as every train
        backend reports it."""
        data = self._replica_batch(batch)
        for chunk in self.chunks:
            chunk.eval()
        out: list[tuple[torch.Tensor, ...]] = []

        def on_head(head: LMHead, mb: Batch, dummy: bool) -> torch.Tensor:
            if not dummy:
                ids = mb.tensors["input_ids"].to(self.device)
                valid = mb.tensors["attention_mask"][:, 1:].to(self.device)
                values = fn(head, ids, valid, temperature=temperature)
                out.append(tuple(v.cpu() for v in values))
            return head.hidden.new_zeros(())

        self._run(data, on_head, forward_only=True)
        width = data.tensors["input_ids"].shape[1] - 1
        valid = batch.tensors["attention_mask"][:, 1:].bool()
        result = {}
        for i, key in enumerate(keys):
            parts = [F.pad(t[i], (0, width - t[i].shape[1])) for t in out]
            rows = self._from_last_stage(torch.cat(parts) if parts else None)
            own = self._own_rows(batch, rows)
            result[key] = own.masked_fill(~valid.to(own.device), 0.0)
        return result

    def _own_rows(self, batch: Batch, rows: torch.Tensor) -> torch.Tensor:
        """This rank's part of its replica's rows (the replica concatenated its ranks' shards
        in rank order)."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        sizes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(sizes, len(batch), group=group)
        start = sum(sizes[: dist.get_rank(group)])
        return rows[start : start + len(batch)]

    def adapters_disabled(self) -> Any:
        raise ValueError("the megatron backend does not support LoRA")

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int, vision: Any = None
    ) -> list[list[int]]:
        """Greedy continuations, a full forward per new token (every rank runs it, in lock
        step: an evaluation helper, not a rollout engine)."""
        if vision:
            raise ConfigError("the megatron backend trains text models only.")
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        seqs = [list(p) for p in prompts]
        done = [False] * len(seqs)
        for chunk in self.chunks:
            chunk.eval()
        for _ in range(max_new_tokens):
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), pad, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, s in enumerate(seqs):  # right padding: each row's last real token
                ids[i, : len(s)] = torch.tensor(s)
                attn[i, : len(s)] = 1
            nxt: list[torch.Tensor] = []
            batch = Batch(tensors={"input_ids": ids, "attention_mask": attn})
            self._run(batch, functools.partial(_next_tokens, nxt), forward_only=True)
            tokens = self._from_last_stage(torch.cat(nxt).cpu() if nxt else None).tolist()
            for i, tok in enumerate(tokens):
                if done[i]:
                    continue
                seqs[i].append(int(tok))
                done[i] = tok == eos
            if all(done):
                break
        out = []
        for s, n in zip(seqs, (len(p) for p in prompts), strict=True):
            new = s[n:]
            out.append(new[: new.index(eos)] if eos in new else new)
        return out

    # ---- weights ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every HF tensor of the model on rank 0 ({} elsewhere). Collective."""
        return dict(iter_hf_tensors(self.shards))

    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.full_state_dict()

    @torch.no_grad()
    def sync_tensors(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight-sync stream in HF names, one gathered tensor at a time (rank 0 yields;
        every rank must iterate it)."""
        yield from iter_hf_tensors(self.shards)

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """The last step's summed gradients in HF names, on rank 0 (collective; exactness
        tests). Needs data parallel size 1: the distributed optimizer leaves each replica only
        its own part of the reduced gradient."""
        if self.layout.dp > 1:
            raise ValueError("full_grads needs data-parallel size 1 (tp * pp = world_size)")
        saved = []
        for chunk in self.chunks:
            for p in chunk.module.parameters():
                saved.append((p, p.data))
                p.data = p.main_grad.view_as(p).to(p.dtype)
        try:
            return self.full_state_dict()
        finally:
            for p, data in saved:
                p.data = data

    def offload_tensors(self, part: str) -> list[torch.Tensor]:
        """What `actor_train.offload` moves for ``part`` (backends/train/offload.py):
        `optimizer`: the AdamW moments of this rank's shard (and, in bf16, its fp32 master
        shard); `grads`: megatron DDP's gradient buffers (persistent, zeroed at each step's
        start: moved whole); `params`: DDP's contiguous parameter buffers, every parameter
        (views of them) and the model's buffers."""
        if part == "optimizer":
            out: list[torch.Tensor] = []
            for opt in _inner_optimizers(self.optimizer):
                for state in opt.state.values():
                    out += [v for k, v in state.items()
                            if isinstance(v, torch.Tensor) and k != "step"]  # fmt: skip
            for chained in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
                for group in getattr(chained, "shard_fp32_from_float16_groups", None) or []:
                    out += list(group)
            return out
        buffers = [b for c in self.chunks for b in (*c.buffers, *c.expert_parallel_buffers)]
        if part == "grads":
            return [b.grad_data for b in buffers]
        if part == "params":
            params = [b.param_data for b in buffers if b.param_data is not None]
            return params + list(self.model.parameters()) + list(self.model.buffers())
        raise ValueError(f"unknown offload part {part!r}")

    def shareable_parameters(self) -> list[torch.Tensor]:
        return []

    def state_digest(self) -> str:
        state = self.full_state_dict()
        return digest(state) if self.rank == 0 else ""

    def export(self, path: Path, *, max_shard_bytes: int = 5 * 2**30) -> None:
        """The model in Hugging Face format: safetensors shards (checkpoint names, as the
        model's own files), its config.json and generation config, the tokenizer. Streamed:
        rank 0 holds one gathered tensor and one shard at a time."""
        from roll_core.convert.hf import HFWriter

        writer = HFWriter(path, max_shard_bytes) if self.rank == 0 else None
        if writer is not None:
            path.mkdir(parents=True, exist_ok=True)
        for name, tensor in iter_hf_tensors(self.shards):
            if writer is not None:
                writer.add(name, tensor)
        if writer is not None:
            from transformers import AutoConfig, GenerationConfig

            writer.close()
            AutoConfig.from_pretrained(self.model_path).save_pretrained(path)
            with contextlib.suppress(OSError):  # the model may have no generation_config.json
                GenerationConfig.from_pretrained(self.model_path).save_pretrained(path)
            self.tokenizer.save_pretrained(path)
        dist.barrier()

    # ---- checkpoints: every rank its own shards ---------------------------------------------
    def save(self, path: Path) -> None:
        """This rank's model shards, optimizer shard, LR schedule and RNG (one file per rank),
        with its place in the layout and the model's config.json: what `roll convert
        mcore2hf` needs to assemble the HF model from the files alone."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        path.mkdir(parents=True, exist_ok=True)
        state = {
            "layout": self._layout_key(),
            "place": self.shards.place.to_dict(),
            "hf_config": dict(self.hf_config),
            "model": [c.module.state_dict() for c in self.chunks],
            "optimizer": [o.state_dict() for o in _inner_optimizers(self.optimizer)],
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "tracker": get_cuda_rng_tracker().get_states(),
        }
        torch.save(state, path / RANK_FILE.format(rank=self.rank))
        dist.barrier()

    def _layout_key(self) -> dict[str, Any]:
        lay = self.layout
        return {"world_size": self.world_size, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep,
                "vpp": lay.vpp, "sp": lay.sp}  # fmt: skip

    def load(self, path: Path) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        file = path / RANK_FILE.format(rank=self.rank)
        if not file.is_file():
            raise CheckpointError(
                f"{path} holds no megatron checkpoint for rank {self.rank} ({file.name}): was "
                "it saved by another actor_train.backend or world size?",
                hint="Resume with the backend and actor_train.megatron layout it was saved with.",
            )
        state = torch.load(file, weights_only=False)
        if state["layout"] != self._layout_key():
            raise CheckpointError(
                f"checkpoint {path} was saved with layout {state['layout']}; this run has "
                f"{self._layout_key()}.",
                hint="Resume with the same actor_train.world_size and actor_train.megatron.",
            )
        with torch.no_grad():
            for chunk, saved in zip(self.chunks, state["model"], strict=True):
                chunk.module.load_state_dict(saved, strict=True)
        for opt, saved in zip(_inner_optimizers(self.optimizer), state["optimizer"], strict=True):
            opt.load_state_dict(saved)
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        get_cuda_rng_tracker().set_states(state["tracker"])


def _log_probs_only(
    head: LMHead, input_ids: torch.Tensor, valid: torch.Tensor, *, temperature: float
) -> tuple[torch.Tensor]:
    return (target_log_probs(head, input_ids, valid, temperature=temperature),)


def _next_tokens(out: list[torch.Tensor], head: LMHead, mb: Batch, dummy: bool) -> torch.Tensor:
    """Greedy next token of every row (right-padded: at its last real position)."""
    attn = mb.tensors["attention_mask"]
    last = torch.zeros(attn.shape, dtype=torch.bool)
    last[torch.arange(len(attn)), attn.sum(dim=1) - 1] = True
    (tokens,) = head.map(last.to(head.device), lambda logits: (logits.argmax(-1),))
    out.append(tokens)
    return head.hidden.new_zeros(())


def _finalize(finalize: Any, model: Any, num_tokens: Any = None, **kwargs: Any) -> None:
    """megatron's finalize_model_grads without its division by the token count."""
    finalize(model, None, **kwargs)


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers (one per parameter group family: dense, experts) inside
    megatron's (chained) distributed optimizer: their state is this rank's shard."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chained]


@contextlib.contextmanager
def deferred_output(layer: Any, deferred: dict[str, Any]) -> Iterator[None]:
    """Inside: megatron's output layer (a ColumnParallelLinear, vocabulary-parallel over the
    TP ranks) returns its input, so the GPTModel's forward returns its last hidden states;
    :class:`LMHead` then applies the layer a chunk of positions at a time (each TP rank its
    vocabulary shard, gathered per chunk: one chunk's [positions, vocabulary] exists at a
    time, and none is kept for the backward). ``deferred`` gets the weight the model passed
    (the embedding's when tied) and the TP group.

    The hidden states come out as the layer's matmul sees them: with sequence parallelism
    gathered over the sequence (the backward reduce-scatters), else copied into the TP region
    (the backward all-reduces): each TP rank's gradient is its vocabulary shard's share, and
    the sum is that of the whole layer. Every TP rank of a replica runs the same
    micro-batches, so each makes the same gathers."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    def forward(
        input_: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        deferred["weight"] = layer.weight if weight is None else weight
        deferred["group"] = layer.tp_group
        if layer.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(input_, True, layer.tp_group)
        else:
            hidden = copy_to_tensor_model_parallel_region(input_, layer.tp_group)
        return hidden, None

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward
