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
import re
import threading
import time
from typing import Any

import torch

from roll_core.backends.infer.base import Completion, Request, SamplingParams
from roll_core.backends.infer.hf_engine import HFEngine
from roll_core.backends.train.torch_backend import resolve_device
from roll_core.data.vision import concat_vision
from roll_core.errors import ModelError
from roll_core.models import load_causal_lm, load_tokenizer
from roll_core.models.loading import is_vision_model
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
    ) -> None:
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
        self.model.eval()
        self.version = 0
        self._targets: dict[str, torch.Tensor] | None = None
        self._model_lock = threading.Lock()  # one forward at a time: generate and the engine
        self.engine = HFEngine(self, model_lock=self._model_lock, max_num_seqs=max_num_seqs)

    @torch.no_grad()
    def generate(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        self.restore(["weights"])  # a call outside the turn order still sees its weights
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
        with self._model_lock, _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self._generate(ids, attn, params, sampling, vision)
        new_tokens = out.sequences[:, width:].cpu()
        temp = params.temperature if sampling else 1.0
        logp = _sampled_log_probs(out.logits, new_tokens, temp)
        end = time.time()
        return [
            self._completion(r, new_tokens[i].tolist(), logp[i].tolist(), params, start, end)
            for i, r in enumerate(requests)
        ]

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
        vision: dict[str, torch.Tensor] | None = None,
    ) -> Any:
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            return self._call_generate(ids, attn, params, sampling, pad, eos, vision or {})

    def _call_generate(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor,
        params: SamplingParams,
        sampling: bool,
        pad: int,
        eos: int,
        vision: dict[str, torch.Tensor] | None = None,
    ) -> Any:
        return self.model.generate(  # type: ignore[operator]
            **(vision or {}),  # VLMs: pixel_values, image_grid_thw, mm_token_type_ids
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
            suppress_tokens=self.suppress,
            output_logits=True,
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


def _sampled_log_probs(
    logits: tuple[torch.Tensor, ...], tokens: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log p(tokens[:, t]) under the raw ``logits[t]`` ([B, V] per step) divided by
    ``temperature``: [B, new] float32 on the CPU. One step at a time, so no [B, new, V] copy
    is made (with a 151k vocabulary and 512 new tokens that is 2.5 GB per 8 rows, per copy);
    each value is the same as in one stacked pass (log-softmax is per row)."""
    if not logits:
        return torch.zeros((tokens.shape[0], 0), dtype=torch.float32)
    cols = [
        torch.log_softmax(step.float() / temperature, dim=-1)
        .gather(-1, tokens[:, t : t + 1].to(step.device))
        .squeeze(-1)
        .cpu()
        for t, step in enumerate(logits)
    ]
    return torch.stack(cols, dim=1)
