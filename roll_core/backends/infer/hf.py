"""The `hf` infer backend: transformers `generate` on a local copy of the policy.

`generate(list)` is the fixed-batch path: a list of requests is generated as one left-padded
batch (the deterministic rollout mode, evaluation). Sampling is seeded per call from the
requests' seeds, so a given set of requests gives the same responses on every run (and after a
resume). Behaviour log-probs are log softmax(raw logits / temperature) of the sampled tokens,
the quantity the trainer recomputes, so `train_infer/logprob_diff` measures only numerics.
Vision-language models get each request's `vision` inputs (pixel_values, image_grid_thw),
concatenated in row order, next to the left-padded ids, and the rows' ``mm_token_type_ids``
(1 at image placeholders): the model's 3-D (mrope) positions, those the trainer and vLLM use.

`generate_request` / `abort` / `pause` / `resume` are the request-level engine (RequestEngine,
backends/infer/base.py): continuous batching on a background thread, hf_engine.py. Both paths
share the model; a lock lets one forward run at a time.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
from typing import Any, TypeGuard

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from roll_core.backends.infer.base import Completion, Request, SamplingParams
from roll_core.backends.infer.hf_engine import HFEngine
from roll_core.backends.train.torch_backend import resolve_device
from roll_core.data.vision import concat_vision
from roll_core.errors import ConfigError, ModelError
from roll_core.models import load_causal_lm, load_tokenizer
from roll_core.models.loading import is_vision_model
from roll_core.models.routing import RouteRecorder
from roll_core.models.vision import image_token_id, vision_token_ids

_GLOBAL_RNG = threading.Lock()

_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def fused_expert_view(targets: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The slice of a fused mixture-of-experts tensor that checkpoint name `name` stands for,
    or None. Checkpoints (and the megatron backend's sync) name every expert's weights
    (``...experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]);
    transformers 5 fuses them into ``...experts.gate_up_proj`` [E, 2I, H] (gate rows first)
    and ``...experts.down_proj`` [E, H, I]."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    e, proj = int(m["e"]), m["proj"]
    if proj == "down":
        fused = targets.get(f"{m['base']}.down_proj")
        return None if fused is None else fused[e]
    fused = targets.get(f"{m['base']}.gate_up_proj")
    if fused is None:
        return None
    half = fused.shape[1] // 2
    return fused[e, :half] if proj == "gate" else fused[e, half:]


class HFInferBackend:
    """InferBackend on transformers' generate, and a RequestEngine (continuous batching of
    at most `max_num_seqs` requests at a time; the rest queue)."""

    supports_prefix_continuation = True
    """Continues from ``Request.prefix_ids`` (the prefix is fed as input ids, exactly)."""

    def __init__(
        self,
        *,
        model_path: str,
        tokenizer_path: str | None = None,
        device: str = "auto",
        dtype: torch.dtype = torch.float32,
        num_threads: int | None = None,
        precision: str = "fp32",
        max_num_seqs: int = 64,
        record_routes: bool = False,
    ) -> None:
        """`record_routes`: every Completion carries the routed experts of its tokens
        (``algorithm.router_replay: r3``; a mixture-of-experts model)."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.device = resolve_device(device)
        # the trainer's rule (torch backend): bf16 autocast when asked, or `auto` on CUDA
        use_bf16 = precision == "bf16" or (precision == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        self.tokenizer = load_tokenizer(tokenizer_path or model_path)
        self.model = load_causal_lm(model_path, dtype=dtype, device=self.device)
        self.model_path = model_path
        self.is_vision = is_vision_model(model_path)
        # never sample an image placeholder (docs/vlm.md): None for text models
        self.suppress = vision_token_ids(self.model.config) if self.is_vision else None
        # the image tokens' mm_token_type_ids give them the model's 3-D rope positions
        self.image_token = image_token_id(self.model.config) if self.is_vision else None
        neutral_generation(self.model, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
        self.model.eval()
        self.route_recorder = RouteRecorder(self.model) if record_routes else None
        self.version = 0
        self._targets: dict[str, torch.Tensor] | None = None
        self._model_lock = threading.Lock()  # one forward at a time: generate and the engine
        self.engine = HFEngine(self, model_lock=self._model_lock, max_num_seqs=max_num_seqs)

    @torch.no_grad()
    def generate(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        self.restore(["weights"])  # a call outside the turn order still sees its weights
        if any(r.adapter is not None for r in requests):
            raise ConfigError(
                "hf backend: requests name LoRA adapters, but the hf backend serves none.",
                hint="Merge the adapter into the weights (update_weights), or use the vllm "
                "backend built with max_lora_rank.",
            )
        if params.stop_token_ids or params.ignore_eos:
            raise ModelError(
                "stop_token_ids and ignore_eos are honoured by the request-level engine only.",
                hint="A bug in the caller: use generate_request for requests with stop tokens.",
            )
        start = time.time()
        pad = self.tokenizer.pad_token_id
        inputs = [r.prompt_ids + r.prefix_ids for r in requests]  # prefix: partial rollout
        width = max(len(x) for x in inputs)
        ids = torch.full((len(requests), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, x in enumerate(inputs):
            ids[i, width - len(x) :] = torch.tensor(x)
            attn[i, width - len(x) :] = 1
        seed = sum(r.seed * 1_000_003**i for i, r in enumerate(requests)) % 2**63
        sampling = params.temperature > 0
        # transformers samples from torch's global RNG: hold it (ranks of the local executor
        # share one process) and restore it, so sampling neither races nor disturbs training.
        vision = self.vision_inputs([r.vision for r in requests], ids)
        if vision and not self.is_vision:
            raise ModelError(
                f"{self.model_path} is a text-only model, but requests carry images.",
                hint="Use a vision-language model (builtin:tiny-qwen2.5-vl, Qwen2.5-VL) for "
                "image prompts.",
            )
        recorder = SampledLogProbs(
            params.temperature if sampling else 1.0, self.suppress, top=params.top_logprobs
        )
        capture: contextlib.AbstractContextManager[Any] = (
            self.route_recorder.capture()
            if self.route_recorder is not None
            else contextlib.nullcontext([])
        )
        with self._model_lock, _GLOBAL_RNG, torch.random.fork_rng(devices=[]), capture as fwd:
            torch.manual_seed(seed)
            out = self._generate(ids, attn, params, sampling, recorder, vision)
        new_tokens = out.sequences[:, width:].cpu()
        logp = recorder.finish(new_tokens)
        end = time.time()
        done = [
            self._completion(r, new_tokens[i].tolist(), logp[i].tolist(), params, start, end)
            for i, r in enumerate(requests)
        ]
        if params.top_logprobs > 0:
            for i, c in enumerate(done):
                c.top_logprobs = recorder.top_of(i, len(c.response_ids))
        if fwd:
            routes = fixed_batch_routes(fwd, ids)
            for i, (c, x) in enumerate(zip(done, inputs, strict=True)):
                fed = width + max(len(c.response_ids) - 1, 0)  # its last token is never fed
                c.routed_experts = routes[i, width - len(x) : fed]
        return done

    def vision_inputs(self, inputs: list[Any], ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's vision keyword arguments for rows `ids` ([B, L], any padding) with
        these per-row vision inputs: pixel values, grids and, for a VLM, the rows'
        ``mm_token_type_ids``, from which ``generate`` computes the 3-D rope positions (and
        their per-row offsets for the decoding steps) as the trainer does."""
        return concat_vision(
            inputs,
            device=self.device,
            input_ids=ids if self.image_token is not None else None,
            image_token_id=self.image_token,
        )

    # ---- request-level serving (RequestEngine; hf_engine.py) ---------------------------------
    def generate_request(self, request: Request, params: SamplingParams) -> Completion:
        """Block until `request` finishes or is aborted; the engine batches it continuously
        with every other request in flight."""
        return self.engine.generate_request(request, params)

    def abort(self, request_ids: list[int]) -> None:
        self.engine.abort(request_ids)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def close(self) -> None:
        """Stop the engine's decoding thread (waiting requests fail)."""
        self.engine.close()

    def _generate(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor,
        params: SamplingParams,
        sampling: bool,
        recorder: SampledLogProbs,
        vision: dict[str, torch.Tensor] | None = None,
    ) -> Any:
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            # vision-language models place even text rows by their own (3-D) positions
            shared = not vision and not self.is_vision
            cache = shared_prompt_cache(self.model, ids, attn, self.device) if shared else None
            return self.model.generate(  # type: ignore[operator]
                **(vision or {}),  # VLMs: pixel_values, image_grid_thw, mm_token_type_ids
                **({"past_key_values": cache} if cache is not None else {}),
                input_ids=ids.to(self.device),
                attention_mask=attn.to(self.device),
                max_new_tokens=params.max_new_tokens,
                do_sample=sampling,
                temperature=params.temperature if sampling else None,
                top_p=params.top_p if sampling else None,
                top_k=params.top_k if sampling else None,
                eos_token_id=eos,
                pad_token_id=pad,
                stop_strings=list(params.stop) or None,
                tokenizer=self.tokenizer if params.stop else None,
                logits_processor=LogitsProcessorList([recorder]),
                return_dict_in_generate=True,
            )

    def _completion(
        self,
        request: Request,
        tokens: list[int],
        logps: list[float],
        params: SamplingParams,
        start: float,
        end: float,
    ) -> Completion:
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if eos in tokens:  # keep the eos token: the model must learn to stop
            n, reason = tokens.index(eos) + 1, "stop"
        else:
            n = len(tokens)
            while n > 0 and tokens[n - 1] == pad and pad != eos:
                n -= 1  # stop string hit: generate pads the rest of the row
            # a stop string: the row stopped before max_new_tokens (if every row stopped,
            # the batch ended early and there are no pads to trim)
            reason = "stop" if n < max(len(tokens), params.max_new_tokens) else "length"
        return Completion(
            request_id=request.request_id,
            response_ids=tokens[:n],
            log_probs=logps[:n],
            finish_reason=reason,
            policy_version=self.version,
            timing={"gen_start": start, "gen_end": end},
        )

    @torch.no_grad()
    def update_weights(self, named_tensors: dict[str, Any], *, version: int) -> None:
        """Load `named_tensors` in place and stamp `version` (the `driver` sync path)."""
        self.load_weights_bucket(list(named_tensors.items()))
        self.finish_sync(version)

    @torch.no_grad()
    def load_weights_bucket(self, items: list[tuple[str, Any]]) -> None:
        """Copy each (name, tensor) into the model's tensor of that name, in place (cast to
        its dtype and device). The sources may be views into a sync buffer: not kept."""
        self.restore(["weights"])  # colocated: the weights may be in CPU memory
        if self._targets is None:
            self._targets = self.model.state_dict(keep_vars=True)  # tied: under both names
        for name, value in items:
            target = self._targets.get(name)
            if target is None:
                target = fused_expert_view(self._targets, name)
            if target is None:
                raise KeyError(f"weight sync: the inference model has no tensor {name!r}")
            target.copy_(torch.as_tensor(value), non_blocking=False)

    def share_weights_bucket(self, items: list[tuple[str, Any]]) -> None:
        """The `same_process` sync with `sync.share`: each model tensor of that name takes the
        trainer's tensor's storage (no copy: the trainer's updates are the engine's weights,
        one model in memory) when dtype, shape and device match; the others are copied as
        :meth:`load_weights_bucket` does. A tensor already sharing is left alone, so a
        trainer that replaced a parameter (a checkpoint load) is shared again."""
        if self._targets is None:
            self._targets = self.model.state_dict(keep_vars=True)  # tied: under both names
        copied = []
        for name, value in items:
            target = self._targets.get(name)
            if not _same_layout(target, value):
                copied.append((name, value))
            elif target.data_ptr() != value.data_ptr():
                target.data = value  # the trainer's storage (tied names: one Parameter)
        if copied:
            self.load_weights_bucket(copied)

    def finish_sync(self, version: int) -> None:
        """The weights loaded since the last call are policy `version`."""
        self.version = version

    # ---- taking turns with a colocated trainer ------------------------------------------------
    def release(self, parts: list[str], *, level: int = 1) -> int:
        """Free `parts`: `weights` (parameters and buffers to CPU memory, storage freed:
        roll_core/backends/offload.py); `kv_cache` (the fixed-batch path keeps none between
        calls: on CUDA the allocator's cached blocks are released; the engine's batch of
        requests still in flight, paused, stays: abort them first to free it). Returns the
        bytes moved."""
        from roll_core.backends.offload import StorageStash

        moved = 0
        if "weights" in parts:
            if getattr(self, "_stash", None) is None:
                self._stash = StorageStash(pin_memory=self.device.type == "cuda")
            tensors = [*self.model.parameters(), *self.model.buffers()]
            moved += self._stash.offload(tensors)
        if "kv_cache" in parts and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return moved

    def restore(self, parts: list[str]) -> int:
        """Undo `release` for `parts`; returns the bytes moved."""
        stash = getattr(self, "_stash", None)
        if "weights" in parts and stash is not None and stash.offloaded:
            return stash.reload()
        return 0

    def get_rng_state(self) -> Any:
        return torch.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        torch.set_rng_state(state)


def fixed_batch_routes(forwards: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The routed experts of every column of a fixed-batch ``generate`` (left-padded input
    `ids` [B, W], then one column per decoding step): ``[B, W + steps, L, K]``, from the
    recorded forwards (RouteRecorder): the prefill ``[B, W]``, or the shared prompt cache's
    ``[U, W - 1]`` (one row per distinct input, :func:`shared_prompt_cache`) and the last
    input column ``[B, 1]``; then ``[B, 1]`` per decoding step."""
    rows, width = ids.shape
    head, rest = forwards[0], forwards[1:]
    if head.shape[0] != rows or head.shape[1] != width:  # the shared prompt cache's forward
        first: dict[tuple[int, ...], int] = {}
        owner = [first.setdefault(tuple(row), len(first)) for row in ids.tolist()]
        head = head[torch.tensor(owner)]
    return torch.cat([head, *rest], dim=1)


def shared_prompt_cache(
    model: Any, ids: torch.Tensor, attn: torch.Tensor, device: torch.device
) -> Any | None:
    """The KV cache of every row's input but its last token, computed once per distinct
    input and copied to the rows that share it (a GRPO group's samples share their prompt:
    16 prompts x 8 samples prefill 16 rows, not 128), or None when no two rows share one.
    ``generate`` then runs only the last prompt token of each row before decoding (it slices
    the input to what the cache does not hold). Positions are generate's own for left-padded
    rows (attention-mask cumsum), so each row attends and is placed exactly as without the
    cache; the values can differ from an unshared prefill in the last bits (another batch
    size), which the behaviour log-probs record. vLLM does the same with its prefix cache.
    Text models only (the engine calls it for those)."""
    if ids.shape[1] < 2:
        return None
    first: dict[tuple[int, ...], int] = {}
    owner = [first.setdefault(tuple(row), len(first)) for row in ids.tolist()]
    if len(first) == len(owner):
        return None
    rows = torch.tensor([owner.index(k) for k in range(len(first))])
    head_ids, head_attn = ids[rows, :-1].to(device), attn[rows, :-1].to(device)
    positions = (head_attn.long().cumsum(-1) - 1).masked_fill(head_attn == 0, 0)
    out = model(
        input_ids=head_ids,
        attention_mask=head_attn,
        position_ids=positions,
        use_cache=True,
        **({"logits_to_keep": 1} if model._supports_logits_to_keep() else {}),
    )
    cache = out.past_key_values
    cache.batch_select_indices(torch.tensor(owner, device=device))
    return cache


class SampledLogProbs(LogitsProcessor):
    """The first (and only) logits processor of the engine's ``generate``: records log
    softmax(raw logits / temperature) of every sampled token, the quantity the trainer
    recomputes, then removes the ``suppress`` ids (image placeholders) from sampling. A token
    sampled at step t is the last input id at step t + 1, so only one [B, V] step is held at a
    time (``output_logits`` keeps every step: with a 151k vocabulary and 512 new tokens that
    is 2.5 GB per 8 rows); :meth:`finish` takes the last step's from the output.

    First in the list because the model's generation config cannot add processors ahead of
    it: the engine's model gets a generation config of its own (:func:`neutral_generation`)."""

    def __init__(
        self, temperature: float, suppress: list[int] | None = None, *, top: int = 0
    ) -> None:
        self.temperature = temperature
        self.suppress = suppress
        self.top = top  # also keep each step's `top` most likely (id, log-prob)
        self.columns: list[torch.Tensor] = []
        self.tops: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: values, ids [B, k]
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self.columns.append(self._take(input_ids[:, -1]))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        if self.top > 0:
            found = torch.topk(self.last, min(self.top, self.last.shape[-1]), dim=-1)
            self.tops.append((found.values.cpu(), found.indices.cpu()))
        if not self.suppress:
            return scores
        banned = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        banned[self.suppress] = True
        return scores.masked_fill(banned, -math.inf)

    def _take(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.last is not None
        return self.last.gather(-1, tokens.to(self.last.device)[:, None]).squeeze(-1).cpu()

    def top_of(self, row: int, n: int) -> list[list[tuple[int, float]]]:
        """Row ``row``'s most likely (id, log-prob) at each of its first ``n`` steps."""
        return [
            list(zip(ids[row].tolist(), values[row].tolist(), strict=True))
            for values, ids in self.tops[:n]
        ]

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[B, new] float32 on the CPU: the log-probs of `new_tokens`, the generated ids."""
        n = new_tokens.shape[1]
        if len(self.columns) < n and self.last is not None:
            self.columns.append(self._take(new_tokens[:, len(self.columns)]))
        self.last = None
        if n == 0:
            return torch.zeros((new_tokens.shape[0], 0), dtype=torch.float32)
        return torch.stack(self.columns[:n], dim=1)


def neutral_generation(model: Any, eos: int | list[int] | None, pad: int | None) -> None:
    """Give `model` a generation config that holds only its stop and pad ids. generate fills
    every argument it is not passed from the model's config, and a checkpoint's
    generation_config.json may carry sampling settings (Qwen2.5-Instruct: repetition_penalty
    1.05, top_k 20, top_p 0.8): the engine would then sample from another distribution than
    the one it reports log-probs for and the trainer trains. roll's SamplingParams are the
    only sampling settings."""
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)


def _same_layout(target: Any, value: Any) -> TypeGuard[torch.Tensor]:
    """Whether `value` can stand in for the model tensor `target` as it is (dtype, shape,
    device)."""
    return (
        isinstance(target, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and (target.dtype, target.shape, target.device) == (value.dtype, value.shape, value.device)
    )
