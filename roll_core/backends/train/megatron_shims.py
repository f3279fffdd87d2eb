"""Process-wide patches that let megatron-core 0.16 train on CPU over gloo.

megatron-core is written for CUDA + NCCL: it asks CUDA for the current device, builds small
tensors with ``device="cuda"``, checks ``Tensor.type()`` strings, keeps its dropout RNG in
CUDA generators and uses collectives gloo does not have. :func:`apply_cpu_shims` patches
exactly those places, once per process, and only when no CUDA device is visible: on GPUs
nothing here runs and megatron-core runs as shipped.

Each shim was found by switching it off and running the CPU tests
(tests/backends/test_megatron.py): the comment above each says what fails without it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

_APPLIED: set[str] = set()


def _cpu(device: Any) -> Any:
    """``device`` with CUDA replaced by the CPU (a string, a torch.device or an index)."""
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cuda_runtime() -> None:
    # megatron asks for the current device everywhere it allocates (`device=
    # torch.cuda.current_device()`: rotary frequencies, DDP's grad buffers, the schedules' p2p
    # buffers, the optimizer's norm tensors), synchronizes around checkpoints and timers, and
    # records events / waits on streams in the DDP buffers and the MoE dispatchers.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda device=None: _NullStream()  # type: ignore[assignment, return-value]
    torch.cuda.default_stream = lambda device=None: _NullStream()  # type: ignore[assignment, return-value]
    torch.cuda.Stream = _NullStream  # type: ignore[assignment, misc]
    torch.cuda.Event = _NullEvent  # type: ignore[assignment, misc]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment, misc]
    torch.Tensor.record_stream = lambda self, s: None  # type: ignore[method-assign]


class _NullStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return _NullEvent()

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class _NullEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand")


def _cuda_factories() -> None:
    # `torch.zeros(..., device="cuda")` / `torch.tensor(..., device="cuda")` in the pipeline
    # schedules (the loss and token counters), the optimizer (found-inf flags, norms) and grad
    # clipping (`total_norm`), and `Tensor.cuda()` (tied embeddings are all-reduced from it).
    for name in _FACTORIES:
        original = getattr(torch, name)

        @functools.wraps(original)
        def factory(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return _original(*args, **kwargs)

        setattr(torch, name, factory)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    original_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to  # type: ignore[method-assign, assignment]


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _tensor_type_names() -> None:
    # megatron's optimizers sort parameters by `param.type()` and refuse anything but
    # 'torch.cuda.FloatTensor' / Half / BFloat16 (distrib_optimizer.py, optimizer.py,
    # clip_grads.py): report CPU floating tensors under their CUDA names. `type(dtype)`
    # (a conversion) is unchanged.
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
        if dtype is None and not kw:
            name = original(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kw)

    torch.Tensor.type = type_  # type: ignore[method-assign, assignment]


def _rng_tracker() -> None:
    # The CUDA RNG tracker (megatron.core.tensor_parallel.random, imported by name in the
    # layers, attention, MoE and embeddings) keeps one generator state per parallel region in
    # CUDA generators. Keep them as CPU generator states instead: `fork` swaps the process's
    # CPU RNG state, so dropout in tensor-parallel regions still differs per TP rank.
    from megatron.core.tensor_parallel import random as mrandom

    def add(self: Any, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self: Any, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)

    mrandom.CudaRNGStatesTracker.add = add  # type: ignore[method-assign]
    mrandom.CudaRNGStatesTracker.fork = fork  # type: ignore[method-assign]


def _norm_under_sequence_parallel() -> None:
    # With `sequence_parallel` megatron refuses its torch RMSNorm / LayerNorm (the local layer
    # spec's norm; Transformer Engine's is CUDA only). The torch norm is correct there: it
    # normalises each token's hidden vector, whichever rank holds the token; its weight's
    # gradient is partial per rank, so mark it `sequence_parallel` and megatron's
    # finalize_model_grads all-reduces it over the tensor-parallel group (what TE's norm does).
    from megatron.core.transformer import torch_norm

    def new(cls: Any, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        if config.normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not supported on CPU")
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new  # type: ignore[method-assign, assignment]


def _gloo_collectives() -> None:
    # gloo has no all_gather of unequal sizes: the MoE dispatcher gathers each tensor-parallel
    # rank's routed tokens with `gather_from_sequence_parallel_region(output_split_sizes=...)`
    # (experts with tp > 1 and sp), and gloo refuses ("allgather: invalid tensor size").
    # Pad to the largest, gather, cut. (Tensor all-gather and reduce-scatter of equal sizes,
    # used by sequence parallelism and the distributed optimizer, gloo has.)
    original_all_gather = dist.all_gather

    def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:  # fmt: skip
        if all(t.shape == tensor.shape for t in tensor_list):
            return original_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.numel() for t in tensor_list)
        padded = torch.zeros(rows, dtype=tensor.dtype)
        padded[: tensor.numel()] = tensor.reshape(-1)
        parts = [torch.empty(rows, dtype=tensor.dtype) for _ in tensor_list]
        original_all_gather(parts, padded, group=group)
        for out, part in zip(tensor_list, parts, strict=True):
            out.copy_(part[: out.numel()].view_as(out))
        return _Done() if async_op else None

    dist.all_gather = all_gather  # type: ignore[assignment]


class _Done:
    """The handle of an `async_op` collective that already ran."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _moe_router_gemm() -> None:
    # megatron-core 0.16 leaves `te_general_gemm` undefined without Transformer Engine; the
    # router's gating linear tests it for None, then uses torch.mm.
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)


def _alltoall_split_sizes() -> None:
    # The alltoall MoE dispatcher moves its split sizes (tokens per expert-parallel rank) from
    # the GPU to numpy with `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts
    # only CUDA tensors: on the CPU they stay tensors and `all_to_all_single` refuses them.
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(
        tensor: Any, as_numpy: bool = False, record_stream: bool = False
    ) -> Any:
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu  # imported by name


SHIMS: dict[str, Callable[[], None]] = {
    "cuda_runtime": _cuda_runtime,
    "cuda_factories": _cuda_factories,
    "tensor_type_names": _tensor_type_names,
    "rng_tracker": _rng_tracker,
    "norm_under_sequence_parallel": _norm_under_sequence_parallel,
    "gloo_collectives": _gloo_collectives,
    "moe_router_gemm": _moe_router_gemm,
    "alltoall_split_sizes": _alltoall_split_sizes,
}
"""Every shim by name (tests switch one off with `skip=` to show what it is for)."""


def apply_cpu_shims(*, skip: tuple[str, ...] = ()) -> list[str]:
    """Apply every shim not in ``skip`` (once per process); nothing when CUDA is available.
    Returns the names applied by this call."""
    if torch.cuda.is_available():
        return []
    done = []
    for name, shim in SHIMS.items():
        if name in skip or name in _APPLIED:
            continue
        shim()
        _APPLIED.add(name)
        done.append(name)
    return done
