"""What `roll serve` holds and does for the Tinker API: sessions, training models, samplers,
checkpoints; one method per route (server.py maps routes and bodies to them).

Naming: a training model is ``<session_id>:train:<model_seq_id>`` (the id the client derives
itself); its checkpoints are ``tinker://<model_id>/weights/<name>`` (adapter + optimizer state)
and ``tinker://<model_id>/sampler_weights/<name>`` (the adapter alone; a sampler merges it into
the base weights), folders under the recipe's ``checkpoints_dir``
(``<model_id>/weights/<name>/``), so a restarted server loads them again.
"""

from __future__ import annotations

import datetime
import json
import shutil
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_core.config.serve import ServeConfig, ServedModel
from roll_core.serve import wire
from roll_core.serve.futures import Futures, Result
from roll_core.serve.sampler import AdapterSampler, Sampler, SamplingSession
from roll_core.serve.trainer import AdamStep, TrainedModel, UserError, lora_targets, read_meta

_KINDS = {"weights": "training", "sampler_weights": "sampler"}


SESSION_ADAPTERS = ".sampler-adapters"
"""Folder under checkpoints_dir of the adapters `save_weights_and_get_sampling_client` writes
for the vllm engine (one per session, removed with it)."""


class NotFound(Exception):
    """An id (session, model, sampler, request, checkpoint) the server does not know."""


@dataclass
class Session:
    id: str
    last_seen: float
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)


class TinkerService:
    """The server's state. Route methods take the request's JSON and return the answer's."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.root = Path(cfg.checkpoints_dir)
        self.futures = Futures(sample_threads=cfg.sample.max_num_seqs)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainedModel] = {}
        self.user_metadata: dict[str, dict[str, str]] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self._oneoff: dict[tuple[str | None, str | None], str] = {}
        self.evicted: set[str] = set()
        self.lock = threading.Lock()
        self.engines: dict[str, Any] = {}  # sample.engine vllm: one per model directory
        if cfg.sample.engine == "vllm":
            # adapters written for sessions of an earlier server that did not stop cleanly
            shutil.rmtree(self.root / SESSION_ADAPTERS, ignore_errors=True)
            self._start_engines()

    def _start_engines(self) -> None:
        """One vLLM engine per model directory (names served by the same weights share it),
        with LoRA adapters per request up to the recipe's max_rank."""
        from roll_core.backends.infer.vllm_backend import VLLMInferBackend
        from roll_core.models.loading import resolve_model_path

        cfg = self.cfg
        try:
            for m in cfg.models:
                path = resolve_model_path(m.path)
                if path in self.engines:
                    continue
                longest = max(
                    x.max_context_length for x in cfg.models if resolve_model_path(x.path) == path
                )
                self.engines[path] = VLLMInferBackend(
                    model_path=path,
                    tokenizer_path=m.tokenizer,
                    device=cfg.train.device,
                    dtype=_engine_dtype(cfg),
                    num_threads=cfg.train.num_threads,
                    cpu_kv_cache_gb=cfg.sample.cpu_kv_cache_gb or 1.0,
                    max_model_len=longest,
                    max_lora_rank=cfg.lora.max_rank,
                    max_loras=cfg.sample.max_samplers,
                    max_num_seqs=cfg.sample.max_num_seqs,
                )
        except BaseException:
            self._close_engines()
            raise

    def _close_engines(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()

    # ---- names -------------------------------------------------------------------------------
    def served(self, name: str | None) -> ServedModel:
        for m in self.cfg.models:
            if m.name == name:
                return m
        names = ", ".join(m.name for m in self.cfg.models)
        raise UserError(f"base_model {name!r} is not served here; served models: {names}")

    def _model(self, model_id: str) -> TrainedModel:
        model = self.models.get(model_id)
        if model is None:
            raise NotFound(f"unknown model_id {model_id!r} (no training client by that id)")
        return model

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"unknown session_id {session_id!r}")
        session.last_seen = time.monotonic()
        return session

    def _new_model_id(self, session: Session, seq: Any) -> str:
        """``<session_id>:train:<model_seq_id>``, the id the client derives itself."""
        if not isinstance(seq, int):
            raise UserError("model_seq_id (an integer) is required")
        model_id = f"{session.id}:train:{seq}"
        if model_id in self.models:
            raise UserError(f"model {model_id} exists already (model_seq_id reused)")
        return model_id

    def _owner(self, model_id: str) -> str:
        for s in self.sessions.values():
            if model_id in s.models:
                return s.id
        return ""

    # ---- sessions ----------------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": m.name,
                    "max_context_length": m.max_context_length,
                    "trainable": True,
                    "sampleable": True,
                }
                for m in self.cfg.models
            ]
        }

    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = f"sess-{uuid.uuid4().hex[:12]}"
        with self.lock:
            self.sessions[sid] = Session(id=sid, last_seen=time.monotonic())
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        self._session(str(body.get("session_id")))
        return {"type": "session_heartbeat"}

    def close_session(self, session_id: str) -> None:
        """Free a session's models and samplers (client finished, or its heartbeats stopped)."""
        with self.lock:
            session = self.sessions.pop(session_id, None)
        if session is None:
            return
        self.futures.forget_session(session_id)
        for mid in session.models:
            self.models.pop(mid, None)
            self.user_metadata.pop(mid, None)
        for sid in session.samplers:
            sampler = self.samplers.pop(sid, None)
            if sampler is not None:
                sampler.close()

    def reap(self) -> list[str]:
        """Close sessions whose heartbeats stopped; their ids."""
        now = time.monotonic()
        stale = [
            s.id
            for s in list(self.sessions.values())
            if now - s.last_seen > self.cfg.session_timeout_s
        ]
        for sid in stale:
            self.close_session(sid)
        return stale

    # ---- training models ---------------------------------------------------------------------
    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        session = self._session(str(body.get("session_id")))
        served = self.served(body.get("base_model"))
        lora = body.get("lora_config") or {}
        rank = int(lora.get("rank", 0) or 0)
        if rank < 1:
            raise UserError("lora_config.rank is required (full fine-tuning is not served)")
        if rank > self.cfg.lora.max_rank:
            raise UserError(
                f"lora rank {rank} is above this server's max_rank {self.cfg.lora.max_rank}"
            )
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise UserError(f"optimizer {optimizer!r} is not served; only adamw")
        targets = lora_targets(
            train_attn=bool(lora.get("train_attn", True)),
            train_mlp=bool(lora.get("train_mlp", True)),
            train_unembed=bool(lora.get("train_unembed", True)),
        )
        model_id = self._new_model_id(session, body.get("model_seq_id"))
        self._keep_metadata(model_id, body)
        seed = lora.get("seed")

        def work() -> Result:
            model = TrainedModel(self.cfg, served, rank=rank, targets=targets, seed=seed)
            with self.lock:
                self.models[model_id] = model
                session.models.append(model_id)
            return Result({"type": "create_model", "model_id": model_id})

        return {
            "request_id": self.futures.submit_train(session.id, model_id, work),
            "model_id": model_id,
        }

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        model = self._model(str(body.get("model_id")))
        return {
            "type": "get_info",
            "model_id": body["model_id"],
            "model_data": {
                "arch": type(model.model.get_base_model()).__name__,  # type: ignore[operator]
                "model_name": model.served.name,
                "tokenizer_id": model.served.tokenizer or model.served.path,
            },
            "is_lora": True,
            "lora_rank": model.rank,
            "model_name": model.served.name,
        }

    def forward_backward(self, body: bytes) -> dict[str, Any]:
        try:
            req = wire.read_forward_backward(body)
        except wire.WireError as err:
            raise UserError(
                f"forward_backward body is not a ForwardBackwardRequest: {err}"
            ) from None
        model = self._model(req.model_id)

        def work() -> Result:
            outputs, metrics = model.forward_backward(
                req.data, req.loss_fn, req.loss_fn_config, backward=not req.forward_only
            )
            return Result(wire.forward_backward_output(outputs, metrics))

        rid = self.futures.submit_train(self._owner(req.model_id), req.model_id, work)
        return {"request_id": rid, "model_id": req.model_id}

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        model = self._model(str(body.get("model_id")))
        params = body.get("adam_params")
        if params is None:
            raise UserError("optim_step: only adam_params are served (no other optimizer)")
        fields = set(AdamStep.__dataclass_fields__)
        unknown = sorted(set(params) - fields - {"type"})
        if unknown:
            raise UserError(f"adam_params: unknown field {unknown[0]!r}")
        adam = AdamStep(**{k: float(v) for k, v in params.items() if k in fields})

        def work() -> Result:
            return Result({"metrics": model.optim_step(adam)})

        rid = self.futures.submit_train(self._owner(body["model_id"]), body["model_id"], work)
        return {"request_id": rid, "model_id": body["model_id"]}

    def unload_model(self, body: dict[str, Any]) -> dict[str, Any]:
        model_id = str(body.get("model_id"))
        self._model(model_id)

        def work() -> Result:
            with self.lock:
                self.models.pop(model_id, None)
                for s in self.sessions.values():
                    if model_id in s.models:
                        s.models.remove(model_id)
            return Result({"type": "unload_model", "model_id": model_id})

        return {"request_id": self.futures.submit_train(self._owner(model_id), model_id, work)}

    # ---- checkpoints -------------------------------------------------------------------------
    def _folder(self, model_id: str, kind: str, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise UserError(f"checkpoint name {name!r}: use a plain name (no '/')")
        return self.root / model_id / kind / name

    def parse_path(self, path: str) -> tuple[str, str, Path]:
        """(model_id, kind, folder) of a ``tinker://`` path of this server."""
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in _KINDS:
            raise UserError(
                f"{path!r} is not a checkpoint path of this server "
                "(tinker://<model_id>/weights/<name> or .../sampler_weights/<name>)"
            )
        folder = self.root / parts[0] / parts[1] / parts[2]
        if not (folder / "meta.json").is_file():
            raise UserError(f"no checkpoint at {path} (looked in {folder})")
        return parts[0], parts[1], folder

    def save_weights(self, body: dict[str, Any], *, sampler: bool) -> dict[str, Any]:
        model_id = str(body.get("model_id"))
        model = self._model(model_id)
        kind = "sampler_weights" if sampler else "weights"
        name = body.get("path")
        if name is None and not sampler:
            name = f"step-{model.steps:06d}"
        session_id = self._owner(model_id)

        def work() -> Result:
            if name is None:  # save_weights_and_get_sampling_client: a sampler, no files
                sid = self._new_sampler(session_id, model.served, model, None)
                return Result({"type": "save_weights_for_sampler", "sampling_session_id": sid})
            folder = self._folder(model_id, kind, str(name))
            if folder.exists():
                if not body.get("overwrite", sampler):
                    raise UserError(f"checkpoint {name!r} exists; pass overwrite=True")
                shutil.rmtree(folder)
            model.save(folder, optimizer=not sampler)
            self._write_run(model_id, model)
            path = f"tinker://{model_id}/{kind}/{name}"
            return Result(
                {"type": "save_weights_for_sampler" if sampler else "save_weights", "path": path}
            )

        return {
            "request_id": self.futures.submit_train(session_id, model_id, work),
            "model_id": model_id,
        }

    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        path = str(body.get("path"))
        _, kind, folder = self.parse_path(path)
        meta = read_meta(folder)
        optimizer = bool(body.get("optimizer", False))
        if optimizer and kind != "weights":
            raise UserError(f"{path} holds no optimizer state (a sampler checkpoint)")
        model_id = body.get("model_id")
        session: Session | None
        if model_id is None:  # create-via-load: the checkpoint says which model to build
            session = self._session(str(body.get("session_id")))
            served = self.served(body.get("base_model") or meta["base_model"])
            model_id = self._new_model_id(session, body.get("model_seq_id"))
            self._keep_metadata(str(model_id), body)
            fresh = True
        else:
            session = (
                self._session(self._owner(str(model_id))) if self._owner(str(model_id)) else None
            )
            current = self._model(str(model_id))
            if (current.rank, current.targets) != (meta["rank"], meta["targets"]):
                raise UserError(
                    f"{path} has LoRA rank {meta['rank']} on {meta['targets']}; this model has "
                    f"rank {current.rank} on {current.targets}"
                )
            served, fresh = current.served, False
        mid = str(model_id)

        def work() -> Result:
            if fresh:
                model = TrainedModel(
                    self.cfg, served, rank=meta["rank"], targets=meta["targets"], seed=None
                )
                with self.lock:
                    self.models[mid] = model
                    if session is not None:
                        session.models.append(mid)
            self.models[mid].load(folder, optimizer=optimizer)
            return Result({"type": "load_weights", "path": path, "model_id": mid})

        owner = session.id if session is not None else ""
        return {"request_id": self.futures.submit_train(owner, mid, work), "model_id": mid}

    def list_checkpoints(self, model_id: str) -> dict[str, Any]:
        found = []
        for kind, ctype in _KINDS.items():
            base = self.root / model_id / kind
            for folder in sorted(base.glob("*/meta.json")) if base.is_dir() else []:
                d = folder.parent
                found.append(
                    {
                        "checkpoint_id": f"{kind}/{d.name}",
                        "checkpoint_type": ctype,
                        "time": datetime.datetime.fromtimestamp(
                            folder.stat().st_mtime, tz=datetime.UTC
                        ).isoformat(),
                        "tinker_path": f"tinker://{model_id}/{kind}/{d.name}",
                        "size_bytes": sum(f.stat().st_size for f in d.rglob("*") if f.is_file()),
                    }
                )
        if not found and model_id not in self.models and not (self.root / model_id).is_dir():
            raise NotFound(f"unknown training run {model_id!r}")
        return {"checkpoints": found, "cursor": None}

    # ---- training runs -----------------------------------------------------------------------
    def _keep_metadata(self, model_id: str, body: dict[str, Any]) -> None:
        meta = body.get("user_metadata") or {}
        if not isinstance(meta, dict):
            raise UserError(f"user_metadata must be an object of strings, not {meta!r}")
        with self.lock:
            self.user_metadata[model_id] = {str(k): str(v) for k, v in meta.items()}

    def _write_run(self, model_id: str, model: TrainedModel) -> None:
        """``<model_id>/run.json`` next to its checkpoints: what ``training_run`` answers
        after a restart."""
        run = {
            "base_model": model.served.name,
            "lora_rank": model.rank,
            "user_metadata": self.user_metadata.get(model_id, {}),
        }
        (self.root / model_id / "run.json").write_text(json.dumps(run))

    def _run_record(self, model_id: str) -> dict[str, Any]:
        model = self.models.get(model_id)
        if model is not None:
            return {
                "base_model": model.served.name,
                "lora_rank": model.rank,
                "user_metadata": self.user_metadata.get(model_id, {}),
            }
        saved = self.root / model_id / "run.json"
        if saved.is_file():
            return dict(json.loads(saved.read_text()))
        for meta in sorted((self.root / model_id).glob("*/*/meta.json")):  # older checkpoints
            m = read_meta(meta.parent)
            return {"base_model": m["base_model"], "lora_rank": m["rank"], "user_metadata": {}}
        raise NotFound(f"unknown training run {model_id!r}")

    def training_run(self, model_id: str) -> dict[str, Any]:
        """``GET training_runs/{id}`` (``RestClient.get_training_run[_by_tinker_path]``): the
        model's base model, rank, ``user_metadata`` from ``create_model`` (the cookbook keeps
        its renderer name there) and its latest checkpoints; also for a saved run of an
        earlier server."""
        run = self._run_record(model_id)
        checkpoints = self.list_checkpoints(model_id)["checkpoints"]

        def last(ctype: str) -> dict[str, Any] | None:
            of_type = [c for c in checkpoints if c["checkpoint_type"] == ctype]
            return max(of_type, key=lambda c: c["time"], default=None)

        latest = [c["time"] for c in checkpoints]
        now = datetime.datetime.now(tz=datetime.UTC).isoformat()
        return {
            "training_run_id": model_id,
            "base_model": run["base_model"],
            "model_owner": self._owner(model_id) or "local",
            "is_lora": True,
            "lora_rank": run["lora_rank"],
            "last_request_time": now if model_id in self.models else max(latest, default=now),
            "last_checkpoint": last("training"),
            "last_sampler_checkpoint": last("sampler"),
            "user_metadata": run["user_metadata"] or None,
        }

    # ---- sampling ----------------------------------------------------------------------------
    def _make_sampler(
        self, served: ServedModel, source: TrainedModel | Path | None, model_path: str | None
    ) -> SamplingSession:
        """A sampler of `served` with the weights of `source`: a live training client's model,
        a saved checkpoint's folder, or None (the base model)."""
        if self.cfg.sample.engine == "vllm":
            from roll_core.models.loading import resolve_model_path

            engine = self.engines[resolve_model_path(served.path)]
            owned = None
            if isinstance(source, TrainedModel):  # its adapter as it is now, in files
                owned = self.root / SESSION_ADAPTERS / uuid.uuid4().hex[:12]
                source.save(owned, optimizer=False)
                source = owned
            adapter = source / "adapter" if source is not None else None
            return AdapterSampler(
                served, engine, adapter_dir=adapter, model_path=model_path, owned=owned
            )
        if isinstance(source, TrainedModel):
            weights = source.merged()
        elif source is not None:
            weights = _merged_from(self.cfg, served, source)
        else:
            weights = None
        return Sampler(self.cfg, served, weights=weights, model_path=model_path)

    def _new_sampler(
        self,
        session_id: str,
        served: ServedModel,
        source: TrainedModel | Path | None,
        model_path: str | None,
    ) -> str:
        sampler = self._make_sampler(served, source, model_path)
        sid = f"samp-{uuid.uuid4().hex[:12]}"
        with self.lock:
            self.samplers[sid] = sampler
            if session_id in self.sessions:
                self.sessions[session_id].samplers.append(sid)
            evicted = []
            while len(self.samplers) > self.cfg.sample.max_samplers:
                old = next(iter(self.samplers))  # least recently used (asample moves to end)
                evicted.append(self.samplers.pop(old))
                self.evicted.add(old)
        for old_sampler in evicted:
            old_sampler.close()
        return sid

    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        session = self._session(str(body.get("session_id")))
        sid = self._open_sampler(session.id, body.get("model_path"), body.get("base_model"))
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def _open_sampler(self, session_id: str, path: str | None, base_model: str | None) -> str:
        """A new sampler on a saved checkpoint's weights (`path`) or a served base model."""
        if path:
            _, _, folder = self.parse_path(str(path))
            served = self.served(read_meta(folder)["base_model"])
            if base_model is not None and base_model != served.name:
                raise UserError(f"{path} was trained on {served.name}, not {base_model}")
            return self._new_sampler(session_id, served, folder, path)
        return self._new_sampler(session_id, self.served(base_model), None, None)

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise NotFound(f"unknown sampler {sampler_id!r}")
        return {
            "sampler_id": sampler_id,
            "base_model": sampler.served.name,
            "model_path": sampler.model_path,
        }

    def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = body.get("sampling_session_id")
        if sid is None:  # one-off sampling by model_path / base_model (no session: kept
            # until the server stops)
            which = (body.get("model_path"), body.get("base_model"))
            sid = self._oneoff.get(which)
            if sid is None or sid not in self.samplers:  # new, or closed to free memory
                sid = self._oneoff[which] = self._open_sampler("", *which)
        with self.lock:
            sampler = self.samplers.pop(str(sid), None)
            if sampler is not None:
                self.samplers[str(sid)] = sampler  # most recently used: evicted last
        if sampler is None and str(sid) in self.evicted:
            raise UserError(
                f"sampling session {sid} was closed to free memory: more than "
                f"sample.max_samplers ({self.cfg.sample.max_samplers}) samplers were open; "
                "create a new sampling client"
            )
        if sampler is None:
            raise NotFound(f"unknown sampling_session_id {sid!r}")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise UserError(f"{key} is not served by roll serve")
        if body.get("target_prompt_logprobs") is not None:
            raise UserError("target_prompt_logprobs is not served by roll serve")
        prompt = _prompt_tokens(body.get("prompt") or {})
        n = int(body.get("num_samples", 1))
        if n < 1:
            raise UserError(f"num_samples must be at least 1, got {n}")
        want_prompt = bool(body.get("prompt_logprobs"))
        # a request's seeds: its seq_id in its sampling session (stable across server runs;
        # SamplingParams.seed overrides)
        seed = int(body.get("seq_id") or 0) * 1_000_003 + zlib.crc32(str(sid).encode()) % 1_000_003
        sp = dict(body.get("sampling_params") or {})

        def work() -> Result:
            seqs = sampler.sample(prompt, sp, num_samples=n, seed=seed)
            plp = sampler.prompt_logprobs(prompt) if want_prompt else None
            return Result(wire.sample_response(seqs, plp))

        owner = next((s.id for s in self.sessions.values() if sid in s.samplers), "")
        rid = self.futures.submit_sample(owner, work)
        return {"request_id": rid, "sample_sequence_ids": [f"{rid}-{i}" for i in range(n)]}

    def close(self) -> None:
        """Stop: queued requests cancelled, running ones finished, no thread left running."""
        self.futures.close()
        self._close_engines()  # vllm: in-flight samples fail (the engine is closed)
        for sampler in list(self.samplers.values()):
            sampler.close()  # hf: the same, for its own engine
        self.futures.join()


def _engine_dtype(cfg: ServeConfig) -> str:
    """The vLLM engine's dtype: bf16 where the trainers compute in bf16 (its sampled log-probs
    then come from the precision the trainers recompute them in), else the weights' dtype."""
    precision = cfg.train.precision
    if precision == "auto":
        import torch

        on_cuda = cfg.train.device == "cuda" or (
            cfg.train.device == "auto" and torch.cuda.is_available()
        )
        precision = "bf16" if on_cuda else "fp32"
    return "bfloat16" if precision == "bf16" else cfg.train.dtype


def _prompt_tokens(prompt: dict[str, Any]) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.get("chunks") or []:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"prompt chunks of type {chunk.get('type')!r} are not served")
        tokens += [int(t) for t in chunk.get("tokens") or []]
    return tokens


def _merged_from(cfg: ServeConfig, served: ServedModel, folder: Path) -> Any:
    """The base weights with a saved adapter folded in."""
    meta = read_meta(folder)
    model = TrainedModel(cfg, served, rank=meta["rank"], targets=meta["targets"], seed=None)
    model.load(folder, optimizer=False)
    return model.merged()
