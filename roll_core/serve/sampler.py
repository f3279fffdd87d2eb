"""Sampling sessions, on the recipe's engine (``sample.engine``):

* ``hf``: a :class:`Sampler` is roll's `hf` request engine (continuous batching) holding one
  set of weights: a served base model's, or a training client's merged into it at
  ``save_weights_for_sampler`` (the weight sync of an RL run: ``update_weights`` in place).
* ``vllm``: one vLLM engine per base model, started with the server; an
  :class:`AdapterSampler` is the base weights or a training client's LoRA adapter, loaded
  into that engine per request (vLLM's multi-LoRA serving): no merged copy of the model per
  session, and requests of every session are batched together.

Log-probs are the engine's own: log softmax(raw logits / temperature) of each sampled token,
the quantity roll's trainers recompute; prompt log-probs are a forward of the same model (hf),
vLLM's ``prompt_logprobs`` (vllm).
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roll_core.backends.infer.base import Request, SamplingParams
from roll_core.backends.infer.hf import HFInferBackend
from roll_core.config.serve import ServeConfig, ServedModel
from roll_core.serve.trainer import UserError
from roll_core.serve.wire import Sequence

if TYPE_CHECKING:
    from roll_core.backends.infer.base import Completion
    from roll_core.backends.infer.vllm_backend import VLLMInferBackend

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class SamplingSession:
    """What every sampling session does with a Tinker request: its parameters, its samples."""

    served: ServedModel
    model_path: str | None
    vocab: int
    _ids: itertools.count[int]
    adapter: int | None = None
    """The LoRA adapter every request of the session names (vllm); None: the engine's weights."""

    def _complete(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        raise NotImplementedError

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def params(self, sp: dict[str, Any], prompt_len: int) -> SamplingParams:
        """roll's SamplingParams of a Tinker ``sampling_params`` mapping."""
        limit = self.served.max_context_length - prompt_len
        max_tokens = sp.get("max_tokens")
        max_tokens = limit if max_tokens is None else int(max_tokens)
        if max_tokens < 1 or max_tokens > limit:
            raise UserError(
                f"max_tokens {max_tokens} with a {prompt_len}-token prompt does not fit "
                f"max_context_length {self.served.max_context_length} of {self.served.name}"
            )
        stop = sp.get("stop")
        stop_strs: tuple[str, ...] = ()
        stop_ids: tuple[int, ...] = ()
        if isinstance(stop, str):
            stop_strs = (stop,)
        elif stop:
            if all(isinstance(s, int) for s in stop):
                stop_ids = tuple(int(s) for s in stop)
            elif all(isinstance(s, str) for s in stop):
                stop_strs = tuple(stop)
            else:
                raise UserError("stop must be strings or token ids, not a mix")
        top_k = int(sp.get("top_k", -1))
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            top_k=0 if top_k < 0 else top_k,
            stop=stop_strs,
            stop_token_ids=stop_ids,
            ignore_eos=stop is not None and not stop_strs and not stop_ids,  # []: no stop at all
        )

    def sample(
        self, prompt: list[int], sp: dict[str, Any], *, num_samples: int, seed: int
    ) -> list[Sequence]:
        """`num_samples` responses to `prompt`, decoded together by the engine."""
        if not prompt:
            raise UserError("the prompt has no tokens")
        if max(prompt) >= self.vocab or min(prompt) < 0:
            raise UserError(f"the prompt holds ids outside the vocabulary (0..{self.vocab - 1})")
        params = self.params(sp, len(prompt))
        if sp.get("seed") is not None:
            seed = int(sp["seed"])
        requests = [
            Request(
                request_id=next(self._ids),
                prompt_ids=list(prompt),
                seed=seed + i,
                adapter=self.adapter,
            )
            for i in range(num_samples)
        ]
        done = self._complete(requests, params)
        return [
            Sequence(
                tokens=c.response_ids,
                logprobs=c.log_probs,
                stop_reason="stop" if c.finish_reason == "stop" else "length",
            )
            for c in done
        ]


class Sampler(SamplingSession):
    """An `hf` engine of its own, holding the session's weights."""

    def __init__(
        self,
        cfg: ServeConfig,
        served: ServedModel,
        *,
        weights: dict[str, torch.Tensor] | None,
        model_path: str | None,
    ) -> None:
        self.served = served
        self.model_path = model_path
        self.engine = HFInferBackend(
            model_path=served.path,
            tokenizer_path=served.tokenizer,
            device=cfg.train.device,
            dtype=_DTYPES[cfg.train.dtype],
            num_threads=cfg.train.num_threads,
            precision=cfg.train.precision,
            max_num_seqs=cfg.sample.max_num_seqs,
        )
        if weights is not None:
            _untie_if_needed(self.engine.model, weights)
            self.engine.update_weights(weights, version=1)
        self.vocab = int(self.engine.model.config.vocab_size)
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=cfg.sample.max_num_seqs)

    def close(self) -> None:
        self.engine.close()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _complete(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        return list(self._pool.map(lambda r: self.engine.generate_request(r, params), requests))

    @torch.no_grad()
    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        """log p(prompt[t] | prompt[:t]) for t >= 1; NaN at t = 0 (no context)."""
        model = self.engine.model
        ids = torch.tensor([prompt], dtype=torch.long, device=self.engine.device)
        dtype = self.engine.autocast_dtype  # the engine's own precision (bf16 autocast or none)
        autocast = (
            torch.autocast(self.engine.device.type, dtype=dtype)
            if dtype is not None
            else contextlib.nullcontext()
        )
        with self.engine._model_lock, autocast:
            logits = model(input_ids=ids).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        picked = logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).cpu().tolist()
        return [float("nan"), *picked]


class AdapterSampler(SamplingSession):
    """A session on the base model's shared vLLM engine: the base weights, or the LoRA adapter
    in `adapter_dir` (PEFT files) that every request of the session names. `owned`: a folder
    written for this session alone (``save_weights_and_get_sampling_client``), removed with
    it."""

    def __init__(
        self,
        served: ServedModel,
        engine: VLLMInferBackend,
        *,
        adapter_dir: Path | None,
        model_path: str | None,
        owned: Path | None = None,
    ) -> None:
        self.served, self.engine, self.model_path, self._owned = served, engine, model_path, owned
        self.adapter = engine.add_adapter(str(adapter_dir)) if adapter_dir is not None else None
        self.vocab = int(engine.llm.model_config.get_vocab_size())
        self._ids = itertools.count()

    def _complete(self, requests: list[Request], params: SamplingParams) -> list[Completion]:
        return self.engine.generate(requests, params)  # submitted together, batched by vLLM

    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        return self.engine.prompt_logprobs(prompt, self.adapter)

    def close(self) -> None:
        if self.adapter is not None:
            self.engine.remove_adapter(self.adapter)
        if self._owned is not None:
            shutil.rmtree(self._owned, ignore_errors=True)


def _untie_if_needed(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Give a model with tied input and output embeddings its own output head when `weights`
    hold two different tensors for them (a LoRA adapter on ``lm_head`` merged into the head
    only): loading both into one shared tensor would move the input embedding too."""
    head, embed = weights.get("lm_head.weight"), None
    for name, value in weights.items():
        if name.endswith("embed_tokens.weight"):
            embed = value
    if head is None or embed is None or torch.equal(head, embed):
        return
    out = model.get_output_embeddings()
    if out.weight is not model.get_input_embeddings().weight:
        return
    out.weight = torch.nn.Parameter(out.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
