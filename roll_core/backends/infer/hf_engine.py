"""Continuous batching for the `hf` infer backend (the RequestEngine of backends/infer/base.py).

One background thread decodes every request in flight as one left-padded batch: a
transformers ``DynamicCache`` whose per-layer key/value tensors hold one row per live request,
a 2D attention mask (0 on each row's left padding) and explicit position ids (each row's own
count of real tokens, so padding never shifts a position). Each step of the loop:

1. requests that were aborted leave the batch (their callers were answered at ``abort``);
2. one decoding forward over the live rows (their last sampled token, one query each);
3. queued requests (up to ``max_num_seqs`` live rows) are prefilled as one left-padded batch
   and merged into the running one (the shorter side is padded on the left);
4. every row samples its next token from its own ``torch.Generator`` (seeded by
   ``Request.seed``), records log softmax(raw logits / temperature) of it, and a row that
   finished (eos, a stop string, ``max_new_tokens``) leaves the batch and its caller gets its
   Completion at once. Columns that only padding uses any more are dropped, so compute
   follows the live rows.

Why not transformers' own continuous batching (``generate_batch`` /
``ContinuousBatchingManager``, 5.19): it samples every request from one global RNG (no
per-request seed, so a response would depend on what else is in flight), its log-probs are
of the processed distribution (after top-p/top-k), not of raw logits / temperature, and it
packs sequences with its paged cache, which has no route for Qwen2.5-VL's pixel values and
3D (mrope) position ids. The loop below is what ``model.generate`` does per step, per row.

Vision-language requests share the batch: their prefill takes their pixel values and token
types (``mm_token_type_ids``, 1 at image placeholders), and their position ids come from the
model's own ``_prepare_position_ids_for_generation`` (the 4-row text + 3-D mrope positions
Qwen2.5-VL's ``generate`` uses, computed per row from that row's own images). Each row keeps
its own last position (``_pos`` ``[4, B]``: a row after an image continues from its image's
largest position, its own rope delta); each decoding step adds 1 to every row's last
position, exactly as ``generate`` does, so rows with different images (or none) decode
together with the positions each would get alone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from roll_core.backends.infer.base import Completion, Request, SamplingParams
from roll_core.errors import ConfigError, ModelError


@dataclass(eq=False)
class _Seq:
    """One request in the engine: queued, live (a row of the batch), or finished."""

    request: Request
    params: SamplingParams
    generator: torch.Generator
    submitted: float
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    """Routed experts of the tokens fed so far (router replay), one ``[n, L, K]`` per forward."""
    done: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.done.is_set()


class EngineClosed(RuntimeError):
    """The engine was closed while a request was waiting."""


class HFEngine:
    """Continuous batching over one HF causal LM (what HFInferBackend's RequestEngine methods
    call). Thread-safe; the decoding thread starts on the first request, :meth:`close`
    stops it.

    `backend` is the HFInferBackend: its model, tokenizer, device, autocast dtype, suppressed
    ids, weights stash and policy version; `model_lock` is held for every forward (the
    fixed-batch ``generate`` holds it too, so both paths can be used on one rank).
    """

    def __init__(self, backend: Any, *, model_lock: threading.Lock, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ConfigError(
                f"hf engine: max_num_seqs must be >= 1, got {max_num_seqs}.",
                hint="Set max_num_seqs to how many requests may decode together (64 is a "
                "good start on CPU; more on a GPU).",
            )
        self.backend = backend
        self.max_num_seqs = max_num_seqs
        self._model_lock = model_lock
        self._cond = threading.Condition()
        self._queue: deque[_Seq] = deque()
        self._by_id: dict[int, _Seq] = {}
        self._paused = False
        self._stepping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        # the batch (touched only by the decoding thread, outside the lock)
        self._live: list[_Seq] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, L] 1 on real tokens
        self._pos: torch.Tensor | None = None  # [P, B] last position id of each row
        self._last: torch.Tensor | None = None  # [B] last sampled token
        self.steps = 0

    # ---- the RequestEngine methods ----------------------------------------------------------
    def generate_request(self, request: Request, params: SamplingParams) -> Completion:
        self._check(request, params)
        gen = torch.Generator(device=self.backend.device)
        gen.manual_seed(int(request.seed) % 2**63)
        seq = _Seq(request, params, gen, time.time())
        with self._cond:
            if self._closed:
                raise EngineClosed("hf engine: closed; no new requests are taken")
            if request.request_id in self._by_id:
                raise ValueError(
                    f"hf engine: request id {request.request_id} is already in flight; "
                    "every in-flight request needs its own id."
                )
            self._by_id[request.request_id] = seq
            self._queue.append(seq)
            self._start_thread()
            self._cond.notify_all()
        seq.done.wait()
        if seq.error is not None:
            raise seq.error
        assert seq.result is not None
        return seq.result

    def abort(self, request_ids: list[int]) -> None:
        with self._cond:
            for rid in request_ids:
                seq = self._by_id.get(rid)
                if seq is not None:
                    self._finish(seq, "abort")  # its row leaves at the next step boundary
            self._cond.notify_all()

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            while self._stepping:
                self._cond.wait()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the decoding thread; requests still waiting fail with EngineClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cond:
            self._fail_all(EngineClosed("hf engine: closed while the request was in flight"))

    def in_flight(self) -> int:
        """Requests queued or decoding."""
        with self._cond:
            return len(self._by_id)

    # ---- bookkeeping (under self._cond) ------------------------------------------------------
    def _check(self, request: Request, params: SamplingParams) -> None:
        if not request.prompt_ids and not request.prefix_ids:
            raise ValueError(f"hf engine: request {request.request_id} has no prompt tokens.")
        if params.max_new_tokens < 1:
            raise ConfigError(
                f"hf engine: max_new_tokens must be >= 1, got {params.max_new_tokens}.",
                hint="Set the sampling max_new_tokens to a positive number.",
            )
        if request.adapter is not None:
            raise ConfigError(
                f"hf engine: request {request.request_id} names LoRA adapter "
                f"{request.adapter}, but the hf engine serves no adapters.",
                hint="Merge the adapter into the engine's weights (update_weights), or use the "
                "vllm backend built with max_lora_rank.",
            )
        if request.vision is not None and not self.backend.is_vision:
            raise ModelError(
                f"{self.backend.model_path} is a text-only model, but request "
                f"{request.request_id} carries images.",
                hint="Use a vision-language model (builtin:tiny-qwen2.5-vl, Qwen2.5-VL) for "
                "image prompts.",
            )

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="hf-engine", daemon=True)
            self._thread.start()

    def _finish(self, seq: _Seq, reason: str) -> None:
        if seq.finished:
            return
        seq.result = Completion(
            request_id=seq.request.request_id,
            response_ids=list(seq.tokens),
            log_probs=list(seq.log_probs),
            finish_reason=reason,
            policy_version=self.backend.version,
            timing={"gen_start": seq.submitted, "gen_end": time.time()},
            top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs > 0 else None,
            routed_experts=self._routes_of(seq),
        )
        self._by_id.pop(seq.request.request_id, None)
        seq.done.set()

    @staticmethod
    def _routes_of(seq: _Seq) -> torch.Tensor | None:
        """The routes of `seq`'s fed tokens, at most its prompt + prefix + response."""
        if not seq.routes:
            return None
        fed = len(seq.request.prompt_ids) + len(seq.request.prefix_ids) + len(seq.tokens)
        return torch.cat(list(seq.routes))[:fed]

    def _capture(self) -> contextlib.AbstractContextManager[Any]:
        """The router recorder's capture (router replay), or nothing."""
        recorder = self.backend.route_recorder
        return recorder.capture() if recorder is not None else contextlib.nullcontext([])

    def _fail_all(self, error: BaseException) -> None:
        for seq in [*self._queue, *self._live, *self._by_id.values()]:
            if not seq.finished:
                seq.error = error
                self._by_id.pop(seq.request.request_id, None)
                seq.done.set()
        self._queue.clear()

    # ---- the decoding thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._paused or not (self._queue or self._live)):
                    self._cond.wait()
                if self._closed:
                    return
                self._stepping = True
                admit = self._admit()
            try:
                self._step(admit)
            except BaseException as err:  # every waiting caller gets the error, none hangs
                with self._cond:
                    self._fail_all(err)  # the admitted ones too: they are in _by_id
                self._reset_batch()
            finally:
                with self._cond:
                    self._stepping = False
                    self._cond.notify_all()

    def _admit(self) -> list[_Seq]:
        while self._queue and self._queue[0].finished:
            self._queue.popleft()  # aborted while queued
        room = self.max_num_seqs - sum(1 for s in self._live if not s.finished)
        admit: list[_Seq] = []
        while self._queue and len(admit) < room:
            seq = self._queue.popleft()
            if not seq.finished:
                admit.append(seq)
        return admit

    def _reset_batch(self) -> None:
        self._live, self._cache, self._mask, self._pos, self._last = [], None, None, None, None

    def _step(self, admit: list[_Seq]) -> None:
        backend = self.backend
        with self._model_lock, torch.no_grad(), self._autocast():
            backend.restore(["weights"])  # a colocated trainer's turn may have stashed them
            self._drop([i for i, s in enumerate(self._live) if s.finished])
            logits: list[torch.Tensor] = []
            if self._live:
                logits.append(self._decode())
            if admit:
                logits.append(self._prefill(admit))
                self._live.extend(admit)
            if not self._live:
                return
            scores = torch.cat(logits, dim=0).float()  # [B, V] raw logits of the next token
            tokens, logps, tops = self._sample(scores)
        self._last = tokens
        self.steps += 1
        self._record(tokens.tolist(), logps.tolist(), tops)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.backend.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.backend.device.type, dtype=dtype)

    def _decode(self) -> torch.Tensor:
        """One forward of every live row's last token; the logits [B, V]."""
        assert self._mask is not None and self._pos is not None and self._last is not None
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(self._live), 1)], dim=1)
        self._pos = self._pos + 1
        with self._capture() as routes:
            out = self.backend.model(
                input_ids=self._last.view(-1, 1),
                attention_mask=self._mask,
                position_ids=self._position_ids(self._pos.unsqueeze(-1)),
                past_key_values=self._cache,
                use_cache=True,
            )
        if routes:
            for seq, row in zip(self._live, routes[-1], strict=True):
                seq.routes.append(row)  # [1, L, K]: the token fed now
        self._cache = out.past_key_values
        return out.logits[:, -1, :]

    def _position_ids(self, pos: torch.Tensor) -> torch.Tensor:
        return pos[0] if pos.shape[0] == 1 else pos  # [B, L] for text models, [P, B, L]

    def _prefill(self, admit: list[_Seq]) -> torch.Tensor:
        """Prefill `admit` as one left-padded batch and merge it into the running one."""
        backend = self.backend
        device = backend.device
        inputs = [s.request.prompt_ids + s.request.prefix_ids for s in admit]
        width = max(len(x) for x in inputs)
        ids = torch.full((len(admit), width), backend.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(inputs):
            ids[i, width - len(x) :] = torch.tensor(x)
            mask[i, width - len(x) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        vision = backend.vision_inputs([s.request.vision for s in admit], ids)
        model_kwargs = {"attention_mask": mask, **(vision or {})}
        pos = backend.model._prepare_position_ids_for_generation(ids, model_kwargs)
        pos = pos if pos.dim() == 3 else pos.unsqueeze(0)  # [P, B, L]
        with self._capture() as routes:
            out = backend.model(
                input_ids=ids,
                position_ids=self._position_ids(pos),
                use_cache=True,
                logits_to_keep=1,
                **model_kwargs,
            )
        for i, (seq, x) in enumerate(zip(admit, inputs, strict=True)):
            if routes:
                seq.routes.append(routes[-1][i, width - len(x) :])  # its prompt + prefix
        self._merge(out.past_key_values, mask, pos[..., -1])
        return out.logits[:, -1, :]

    def _merge(self, cache: Any, mask: torch.Tensor, pos: torch.Tensor) -> None:
        if self._cache is None:
            self._cache, self._mask, self._pos = cache, mask, pos
            _check_cache(cache)
            return
        assert self._mask is not None and self._pos is not None
        old, new = self._mask.shape[1], mask.shape[1]
        width = max(old, new)
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
            mine.values = torch.cat(
                [_pad_left(mine.values, width), _pad_left(theirs.values, width)]
            )
        self._mask = torch.cat([_pad_left(self._mask, width, dim=1), _pad_left(mask, width, dim=1)])
        self._pos = torch.cat([self._pos, pos], dim=1)

    def _drop(self, rows: list[int]) -> None:
        """Remove `rows` from the batch, then the columns only padding uses."""
        if not rows:
            return
        gone = set(rows)
        keep = [i for i in range(len(self._live)) if i not in gone]
        self._live = [self._live[i] for i in keep]
        if not keep:
            self._reset_batch()
            return
        assert self._mask is not None and self._pos is not None and self._last is not None
        index = torch.tensor(keep, device=self._mask.device)
        mask = self._mask[index]
        first = int((mask.sum(dim=0) > 0).nonzero()[0])  # first column some live row uses
        for layer in self._cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]
        self._mask = mask[:, first:]
        self._pos = self._pos[:, index]
        self._last = self._last[index]

    def _sample(
        self, scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, float]] | None]]:
        """Each row's next token (its own generator), log softmax(raw / temperature) of it, and
        the row's ``top_logprobs`` most likely (id, log-prob) of that same log softmax."""
        params = [s.params for s in self._live]
        temps = torch.tensor(
            [p.temperature if p.temperature > 0 else 1.0 for p in params], device=scores.device
        ).unsqueeze(-1)
        logps_all = torch.log_softmax(scores / temps, dim=-1)
        processed = scores.clone()
        if self.backend.suppress:
            processed[:, list(self.backend.suppress)] = -float("inf")
        processed = warp(processed / temps, params)
        tokens = processed.argmax(dim=-1)  # greedy rows; sampled rows are overwritten
        for i, (p, seq) in enumerate(zip(params, self._live, strict=True)):
            if p.temperature > 0:  # each request draws from its own generator
                probs = torch.softmax(processed[i], dim=-1)
                tokens[i] = torch.multinomial(probs, 1, generator=seq.generator)[0]
        logps = logps_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        tops: list[list[tuple[int, float]] | None] = [None] * len(params)
        for i, p in enumerate(params):
            if p.top_logprobs > 0:
                top = torch.topk(logps_all[i], min(p.top_logprobs, logps_all.shape[-1]))
                tops[i] = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        return tokens, logps, tops

    def _record(
        self,
        tokens: list[int],
        logps: list[float],
        tops: list[list[tuple[int, float]] | None],
    ) -> None:
        """Append each row's token; answer the rows that finished (their rows leave at the
        next step)."""
        eos = self.backend.tokenizer.eos_token_id
        with self._cond:
            for seq, tok, lp, top in zip(self._live, tokens, logps, tops, strict=True):
                if seq.finished:
                    continue  # aborted during the step: its answer is already out
                seq.tokens.append(tok)
                seq.log_probs.append(lp)
                if top is not None:
                    seq.top_logprobs.append(top)
                ended = tok == eos and not seq.params.ignore_eos
                if ended or tok in seq.params.stop_token_ids or self._hit_stop(seq):
                    self._finish(seq, "stop")
                elif len(seq.tokens) >= seq.params.max_new_tokens:
                    self._finish(seq, "length")

    def _hit_stop(self, seq: _Seq) -> bool:
        """A stop string completed by the newest token (matched on decoded text, as
        transformers' StopStringCriteria does: it may overhang either end)."""
        if not seq.params.stop:
            return False
        decode = self.backend.tokenizer.decode
        ids = seq.request.prompt_ids + seq.request.prefix_ids + seq.tokens
        for stop in seq.params.stop:
            tail = ids[-(len(stop) + 1) :]
            if stop in decode(tail) and stop not in decode(tail[:-1]):
                return True
        return False


def warp(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """transformers' top-k then top-p warpers, per row ([B, V] scores already / temperature;
    filtered entries become -inf; top_k 0 and top_p 1 leave a row alone)."""
    out = scores
    vocab = scores.shape[-1]
    ks = [min(p.top_k, vocab) if p.temperature > 0 else 0 for p in params]
    if any(k > 0 for k in ks):
        kk = torch.tensor(ks, device=scores.device)
        top = torch.topk(out, max(ks), dim=-1).values  # [B, max k], descending
        kth = top.gather(-1, (kk - 1).clamp(min=0).unsqueeze(-1))
        kth = kth.masked_fill(kk.unsqueeze(-1) == 0, -float("inf"))  # top_k 0: keep all
        out = out.masked_fill(out < kth, -float("inf"))
    ps = [p.top_p if p.temperature > 0 else 1.0 for p in params]
    if any(p < 1.0 for p in ps):
        top_p = torch.tensor(ps, device=scores.device, dtype=out.dtype).unsqueeze(-1)
        sorted_logits, sorted_idx = torch.sort(out, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False  # keep at least one token
        remove = remove & (top_p < 1.0)
        out = out.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))
    return out


def _pad_left(x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """`x` with zeros prepended along `dim` up to `width` (keys/values: [B, H, L, D])."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _check_cache(cache: Any) -> None:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(x).__name__ for x in layers or []}) or [type(cache).__name__]
        raise ModelError(
            f"hf engine: the model's KV cache has layers of type {', '.join(kinds)}; "
            "continuous batching needs full-attention DynamicLayer caches (rows are padded, "
            "merged and dropped).",
            hint="Use the vllm backend for this model, or the fixed-batch path "
            "(rollout.deterministic: true).",
        )


__all__ = ["EngineClosed", "HFEngine", "warp"]
