"""LLM-as-judge reward: another model reads the question, the reference and the response
and gives a score, parsed from its reply and mapped to [0, 1].

Backends (options: :class:`~roll_core.config.reward_options.JudgeConfig`):

* ``http``: an OpenAI-compatible ``POST {base_url}/chat/completions`` (``vllm serve``,
  SGLang, a hosted API), through :mod:`requests` with a per-request timeout; timeouts,
  connection errors, 429 and 5xx replies are retried ``retries`` times with exponential
  backoff. The API key is read from the environment variable ``api_key_env``.
* ``hf``: a transformers causal LM loaded in this process by :mod:`roll_core.models`
  (greedy decoding with the tokenizer's chat template); for small judges and tests. It uses
  the models layer, not ``roll_core.backends`` (a layer above rewards), and needs thread
  isolation (the model stays in the driver).

A judgment that fails (unreachable server, bad reply, no parsable score, score outside the
scale) scores 0.0 with ``info["judge_error"]`` and is counted in ``metrics()``
(``judge/failures``); it never raises, so a judge outage costs reward, not the run.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from roll_core.config.reward_options import JudgeConfig
from roll_core.rewards.base import RewardResult, RewardSample

__all__ = ["JudgeError", "JudgeReward", "build_prompt", "parse_score"]


class JudgeError(Exception):
    """A judgment that failed; the reward turns it into score 0 and a count."""


def build_prompt(cfg: JudgeConfig, sample: RewardSample) -> str:
    """The judge prompt for ``sample`` (the template filled in)."""
    question = sample.row.get(cfg.question_key)
    reference = sample.row.get(cfg.reference_key)
    return cfg.template.format(
        question=sample.prompt if question is None else question,
        reference="(none)" if reference is None else reference,
        response=sample.response,
        scale_min=_num(cfg.scale_min),
        scale_max=_num(cfg.scale_max),
    )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def parse_score(cfg: JudgeConfig, reply: str) -> float:
    """The score in ``reply`` (last match of ``score_pattern``), normalised if configured.

    Raises:
        JudgeError: no match, or a score outside ``[scale_min, scale_max]``.
    """
    found = re.findall(cfg.score_pattern, reply)
    if not found:
        raise JudgeError(f"no score in the judge's reply {reply[:120]!r}")
    last = found[-1]
    text = last[0] if isinstance(last, tuple) else last
    try:
        value = float(text)
    except ValueError:
        raise JudgeError(f"the judge's score {text[:40]!r} is not a number") from None
    if not cfg.scale_min <= value <= cfg.scale_max:
        raise JudgeError(f"score {value:g} is outside [{cfg.scale_min:g}, {cfg.scale_max:g}]")
    if cfg.normalize:
        return (value - cfg.scale_min) / (cfg.scale_max - cfg.scale_min)
    return value


class _Http:
    """The OpenAI-compatible chat-completions client (one requests.Session)."""

    def __init__(self, cfg: JudgeConfig) -> None:
        import requests

        self.cfg = cfg
        self.requests = requests
        self.session = requests.Session()
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        if cfg.api_key_env and not key:
            raise JudgeError(
                f"environment variable {cfg.api_key_env} (the judge API key) is not set"
            )
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"

    def complete(self, messages: list[dict[str, str]]) -> str:
        cfg = self.cfg
        body = {
            "model": cfg.model,
            "messages": messages,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            **cfg.extra_body,
        }
        last = "no attempt"
        for attempt in range(cfg.retries + 1):
            if attempt:
                time.sleep(cfg.retry_backoff_s * 2 ** (attempt - 1))
            try:
                reply = self.session.post(
                    self.url, json=body, headers=self.headers, timeout=cfg.request_timeout_s
                )
            except self.requests.RequestException as err:  # timeout, refused, reset
                last = f"{type(err).__name__}: {str(err)[:200]}"
                continue
            if reply.status_code == 429 or reply.status_code >= 500:
                last = f"HTTP {reply.status_code}: {reply.text[:200]}"
                continue
            if reply.status_code != 200:  # 4xx: the request is wrong, retrying will not help
                raise JudgeError(f"HTTP {reply.status_code}: {reply.text[:300]}")
            try:
                content = reply.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError) as err:
                raise JudgeError(f"malformed reply ({err!r}): {reply.text[:200]}") from None
            return content or ""
        raise JudgeError(f"the judge failed after {cfg.retries + 1} attempts: {last}")

    def close(self) -> None:
        self.session.close()


class _Hf:
    """A local transformers judge (greedy), loaded through roll_core.models."""

    def __init__(self, cfg: JudgeConfig) -> None:
        from roll_core.models.loading import load_causal_lm, load_tokenizer

        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model)
        self.model: Any = load_causal_lm(cfg.model)
        self.model.eval()
        self.lock = threading.Lock()  # one generate at a time

    def complete(self, messages: list[dict[str, str]]) -> str:
        import torch

        from roll_core.data.chat import render_chat  # data/ pulls in `datasets`: load lazily

        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = render_chat(tok, messages, add_generation_prompt=True)
        else:
            text = "\n\n".join(m["content"] for m in messages) + "\n"
        ids = tok(text, return_tensors="pt")
        with self.lock, torch.no_grad():
            out = self.model.generate(
                **ids,
                max_new_tokens=self.cfg.max_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        return str(tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))

    def close(self) -> None:
        pass


@dataclass
class _Counts:
    calls: int = 0
    failures: int = 0
    seconds: float = 0.0
    score_sum: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class JudgeReward:
    """The ``judge`` reward. ``info``: ``judge_score`` (None on failure), ``judge_error``,
    ``judge_reply`` (the first 200 characters)."""

    judge: JudgeConfig | None = None
    _state: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_state", {"lock": threading.Lock(), "counts": _Counts()})

    @property
    def cfg(self) -> JudgeConfig:
        """The options (defaults when none were given)."""
        return self.judge or JudgeConfig()

    def __getstate__(self) -> dict[str, Any]:
        return {"judge": self.judge}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        object.__setattr__(self, "judge", state["judge"])
        self.__post_init__()

    def _client(self) -> _Http | _Hf:
        state = self._state
        with state["lock"]:
            if "client" not in state:
                state["client"] = _Http(self.cfg) if self.cfg.backend == "http" else _Hf(self.cfg)
                state["slots"] = threading.BoundedSemaphore(self.cfg.max_concurrent)
            return state["client"]

    def warmup(self) -> None:
        """Create the client (``hf``: load the model) before the first sample."""
        self._client()

    def __call__(self, sample: RewardSample) -> RewardResult:
        cfg = self.cfg
        start = time.perf_counter()
        reply = ""
        try:
            client = self._client()
            messages = [{"role": "user", "content": build_prompt(cfg, sample)}]
            if cfg.system_prompt:
                messages.insert(0, {"role": "system", "content": cfg.system_prompt})
            with self._state["slots"]:
                reply = client.complete(messages)
            score = parse_score(cfg, reply)
            error = None
        except Exception as err:  # never crash the run: score 0, counted
            score, error = None, (str(err) if isinstance(err, JudgeError) else repr(err))[:300]
        seconds = time.perf_counter() - start
        with self._state["lock"]:
            counts: _Counts = self._state["counts"]
            counts.calls += 1
            counts.seconds += seconds
            if error is None and score is not None:
                counts.score_sum += score
            else:
                counts.failures += 1
                kind = error.split(":")[0][:40] if error else "unknown"
                counts.reasons[kind] = counts.reasons.get(kind, 0) + 1
        info = {"judge_score": score, "judge_error": error, "judge_reply": reply[:200]}
        return RewardResult(0.0 if score is None else score, info)

    def metrics(self, *, reset: bool = True) -> dict[str, float]:
        """``judge/calls``, ``judge/failures``, ``judge/score_mean`` (successful calls),
        ``judge/latency_ms`` since the last call (without the router's domain prefix)."""
        with self._state["lock"]:
            c: _Counts = self._state["counts"]
            if reset:
                self._state["counts"] = _Counts()
        if not c.calls:
            return {}
        out = {
            "judge/calls": float(c.calls),
            "judge/failures": float(c.failures),
            "judge/latency_ms": 1000.0 * c.seconds / c.calls,
        }
        if c.calls > c.failures:
            out["judge/score_mean"] = c.score_sum / (c.calls - c.failures)
        return out

    def close(self) -> None:
        """Close the HTTP session."""
        client = self._state.get("client")
        if client is not None:
            client.close()
