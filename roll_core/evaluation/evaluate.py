"""`roll eval`: score a model's answers to a dataset with a reward; accuracy, pass@k, length.

::

    result = evaluate("my-run", EvalSettings(data="data/tiny-arith/test.jsonl", n=8,
                                             temperature=1.0))
    result.metrics   # {"accuracy": .., "pass@1": .., "pass@8": .., "response_length_mean": ..}

Every prompt is rendered with the model's chat template (as training renders it) and
answered ``n`` times by an infer backend (``hf`` or ``vllm``, the ones training generates
with); request ``i * n + j`` is seeded ``seed + i * n + j``, so a result repeats exactly.
Each answer is scored by the reward stage RLVR training uses (the same reward registry,
isolation and timeouts). A sample is correct when its reward reports ``info["correct"]``
(math, choice, code); rewards that grade nothing (format, a user score) give the reward mean
only. One JSON line per dataset row (its responses, rewards, correctness, lengths) goes to
the output file, the metrics to a ``.summary.json`` beside it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from roll_core.backends.infer import INFER_BACKENDS, Request, SamplingParams, make_infer_backend
from roll_core.config.reward import RewardConfig, check_reward_name
from roll_core.data import encode_prompt, load_rows, require_columns
from roll_core.errors import ConfigError, DataError, UsageError
from roll_core.evaluation.models import ResolvedModel, resolve_model_or_run
from roll_core.evaluation.passk import ks_for, mean_pass_at_k
from roll_core.models import load_tokenizer, resolve_model_path
from roll_core.rollout.one_turn import Prompt, Sample
from roll_core.rollout.rewards import RewardStage
from roll_core.runs import atomic_write_text

Progress = Callable[[int, int], None]
"""``progress(samples_done, samples_total)``, called after every generated batch."""

_EVAL_DOMAIN = "eval"
_NO_DOMAIN_KEY = "\x00roll-eval-domain"  # a column no row has: every row is `eval`
_ANSWER_REWARDS = ("math", "choice")  # built-ins that read the reference answer


@dataclass(frozen=True)
class EvalSettings:
    """What `roll eval` asks for; None: the run's setting, else the default named."""

    data: str
    reward: str | None = None
    """A registered reward or ``pkg.module:function``. None: the run's reward section (RLVR
    runs), else ``math``."""
    n: int = 1
    temperature: float | None = None
    """None: 0 (greedy) for n = 1, else 1.0."""
    top_p: float = 1.0
    max_new_tokens: int | None = None
    """None: the run's eval/rollout budget, else 64."""
    prompt_key: str | None = None
    answer_key: str | None = None
    system_prompt: str | None = None
    max_rows: int | None = None
    backend: str = "hf"
    seed: int = 0
    batch_size: int = 64
    out: str | None = None


@dataclass
class EvalResult:
    model: ResolvedModel
    settings: EvalSettings
    """The settings as run (defaults filled in)."""
    metrics: dict[str, float]
    out: Path
    summary: Path


def check_settings(s: EvalSettings) -> EvalSettings:
    """Validate `s` and fill in the temperature.

    Raises:
        UsageError: a bad n, temperature, top-p, token budget, batch size, row limit,
            backend or reward name.
    """
    if s.n < 1:
        raise UsageError(f"--n must be at least 1, got {s.n}.")
    temperature = s.temperature if s.temperature is not None else (0.0 if s.n == 1 else 1.0)
    if temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0: greedy), got {temperature:g}.")
    if s.n > 1 and temperature == 0:
        raise UsageError(
            f"--n {s.n} with --temperature 0: greedy decoding gives the same answer {s.n} "
            "times, so pass@k would equal pass@1.",
            hint="Sample with a temperature > 0 (e.g. --temperature 1.0), or use --n 1.",
        )
    if not 0 < s.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {s.top_p:g}.")
    for flag, value in (
        ("--max-new-tokens", s.max_new_tokens),
        ("--max-rows", s.max_rows),
        ("--batch-size", s.batch_size),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}.")
    if s.backend not in INFER_BACKENDS:
        raise UsageError(
            f"--backend: unknown backend {s.backend!r}; valid: {', '.join(INFER_BACKENDS)}."
        )
    if s.reward is not None:
        try:
            check_reward_name(s.reward)
        except ValueError as err:
            raise UsageError(f"--reward: {err}.") from None
    return replace(s, temperature=temperature)


def evaluate(
    model_or_run: str,
    settings: EvalSettings,
    *,
    runs_dir: str | Path = "runs",
    progress: Progress | None = None,
) -> EvalResult:
    """Evaluate `model_or_run` (see :mod:`roll_core.evaluation.models`) on `settings.data`."""
    s = check_settings(settings)
    if not Path(s.data).expanduser().exists() and not re.match(r"^[\w.-]+/[\w.-]+$", s.data):
        raise DataError(
            f"--data: no file or directory {s.data} (resolved to {Path(s.data).absolute()}).",
            hint="Give a .jsonl/.json/.csv/.parquet file or a directory of them (or a hub "
            "dataset org/name); `roll data arith DIR` writes the tiny arithmetic set.",
        )
    model = resolve_model_or_run(model_or_run, runs_dir=runs_dir)
    s = _run_defaults(model, s)
    reward_cfg = _reward_config(model, s.reward)
    tokenizer = load_tokenizer(model.path)
    prompts = _load_prompts(s, tokenizer, needs_answer=_needs_answer(reward_cfg))
    out = Path(s.out) if s.out else default_out_path(model, s)
    stage = RewardStage(reward_cfg, tokenizer=tokenizer, domains=_domains(reward_cfg, prompts))
    try:
        stage.router.check_rows(p.row for p in prompts)
        samples = _generate_and_score(model, s, prompts, stage, progress)
    finally:
        stage.close()
    metrics = summarize(samples, n=s.n)
    _write_results(out, prompts, samples, tokenizer)
    summary = summary_path(out)
    record = {
        "model": model.label,
        "model_path": model.path,
        "settings": asdict(s),
        "rows": len(prompts),
        "metrics": metrics,
    }
    atomic_write_text(summary, json.dumps(record, indent=1) + "\n")
    return EvalResult(model=model, settings=s, metrics=metrics, out=out, summary=summary)


def _run_defaults(model: ResolvedModel, s: EvalSettings) -> EvalSettings:
    """Fill what the user left unset from the run's config (or the plain defaults)."""
    budget = model.setting("eval", "max_new_tokens") or model.setting("rollout", "max_new_tokens")
    if not isinstance(budget, int):
        budget = None
    answer = model.setting("data", "answer_key") or model.setting("data", "response_key")
    return replace(
        s,
        prompt_key=s.prompt_key or model.setting("data", "prompt_key") or "prompt",
        answer_key=s.answer_key or answer or "answer",
        system_prompt=s.system_prompt
        if s.system_prompt is not None
        else model.setting("data", "system_prompt"),
        max_new_tokens=s.max_new_tokens or budget or 64,
    )


def _reward_config(model: ResolvedModel, reward: str | None) -> RewardConfig:
    """`reward` for every row, or the RLVR run's own reward section when none is named."""
    run_reward = model.setting("reward") if model.setting("pipeline") == "rlvr" else None
    if reward is None and isinstance(run_reward, dict):
        try:
            cfg = RewardConfig.model_validate(run_reward)
        except ValueError as err:
            raise ConfigError(f"the reward section of {model.label} does not load: {err}") from None
        if cfg.default_domain is None and len(cfg.domains) == 1:
            cfg = cfg.model_copy(update={"default_domain": next(iter(cfg.domains))})
        return cfg
    section = {"rewards": [{"name": reward or "math"}]}
    return RewardConfig.model_validate(
        {
            "domains": {_EVAL_DOMAIN: section},
            "domain_key": _NO_DOMAIN_KEY,
            "default_domain": _EVAL_DOMAIN,
        }
    )


def _needs_answer(cfg: RewardConfig) -> bool:
    return any(fn.name in _ANSWER_REWARDS for d in cfg.domains.values() for fn in d.rewards)


def _domains(cfg: RewardConfig, prompts: list[Prompt]) -> set[str | None]:
    return {p.row.get(cfg.domain_key) for p in prompts}


IMAGE_COLUMN = "images"
"""The image column of vision-language data (``data.image_key``'s default), refused here."""


def _load_prompts(s: EvalSettings, tokenizer: Any, *, needs_answer: bool) -> list[Prompt]:
    assert s.prompt_key is not None and s.answer_key is not None
    rows = load_rows(s.data, split="test", max_rows=s.max_rows, key="--data")
    columns = [s.prompt_key] + ([s.answer_key] if needs_answer else [])
    require_columns(rows, columns, what=f"the eval data {s.data}")
    if IMAGE_COLUMN in rows.column_names and any(rows[IMAGE_COLUMN]):
        raise DataError(
            f"{s.data} has images (column {IMAGE_COLUMN!r}); roll eval scores text prompts only "
            "and would ignore them.",
            hint="Measure image accuracy with the validation of `roll train rlvr` "
            "(eval.every_steps; step 0 scores the starting model), see docs/vlm.md.",
        )
    prompts = []
    for i, row in enumerate(rows):
        text = row.get(s.prompt_key)
        if not isinstance(text, str) or not text.strip():
            raise DataError(
                f"row {i} of {s.data} has no prompt text in column {s.prompt_key!r}.",
                hint="Fix or drop the row, or name the prompt column with --prompt-key.",
            )
        if s.answer_key != "answer" and s.answer_key in row:  # rewards read row["answer"]
            row = {**row, "answer": row[s.answer_key]}
        ids = encode_prompt(tokenizer, text, system=s.system_prompt)
        prompts.append(Prompt(index=i, prompt_ids=ids, row=dict(row)))
    if not prompts:
        raise DataError(f"{s.data} has no rows to evaluate.")
    return prompts


def _generate_and_score(
    model: ResolvedModel,
    s: EvalSettings,
    prompts: list[Prompt],
    stage: RewardStage,
    progress: Progress | None,
) -> list[Sample]:
    """n samples per prompt (in prompt order), each with its reward."""
    assert s.temperature is not None and s.max_new_tokens is not None
    params = SamplingParams(
        max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p
    )
    jobs = [(p, j) for p in prompts for j in range(s.n)]
    backend = make_infer_backend(s.backend, **_backend_kwargs(model, s))
    samples: list[Sample] = []
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            for start in range(0, len(jobs), s.batch_size):
                chunk = jobs[start : start + s.batch_size]
                uids = [p.index * s.n + j for p, j in chunk]
                requests = [
                    Request(uid, p.prompt_ids, seed=s.seed + uid)
                    for uid, (p, _) in zip(uids, chunk, strict=True)
                ]
                completions = backend.generate(requests, params)
                batch = [
                    Sample(uid, p.index, p, c.response_ids, c.log_probs, c.finish_reason, 0)
                    for uid, (p, _), c in zip(uids, chunk, completions, strict=True)
                ]
                for sample, (reward, info) in zip(
                    batch, pool.map(stage.score_sample, batch), strict=True
                ):
                    sample.reward, sample.reward_info = reward, info
                samples += batch
                if progress is not None:
                    progress(len(samples), len(jobs))
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            close()
    return samples


def _backend_kwargs(model: ResolvedModel, s: EvalSettings) -> dict[str, Any]:
    path = resolve_model_path(model.path)
    if s.backend == "vllm":
        return {"model_path": path, "dtype": "float32", "seed": s.seed}
    return {"model_path": path}


def summarize(samples: list[Sample], *, n: int) -> dict[str, float]:
    """Metrics of scored samples, n per prompt in prompt order.

    ``accuracy`` (correct / samples) and ``pass@k`` are present only when the reward grades
    (reports a bool ``info["correct"]``); a sample whose reward failed counts as wrong.
    """
    count = max(1, len(samples))
    metrics = {
        "prompts": float(len(samples) // n),
        "samples": float(len(samples)),
        "reward_mean": sum(s.reward for s in samples) / count,
        "response_length_mean": sum(len(s.response_ids) for s in samples) / count,
        "truncated_fraction": sum(s.finish_reason == "length" for s in samples) / count,
    }
    if any(isinstance(s.reward_info.get("correct"), bool) for s in samples):
        correct = [s.reward_info.get("correct") is True for s in samples]
        metrics["accuracy"] = sum(correct) / count
        per_prompt = [sum(correct[i : i + n]) for i in range(0, len(correct), n)]
        for k in ks_for(n):
            metrics[f"pass@{k}"] = mean_pass_at_k(n, per_prompt, k)
    errors = sum(s.reward_info.get("error") is not None for s in samples)
    metrics["reward_errors"] = float(errors)
    return metrics


def default_out_path(model: ResolvedModel, s: EvalSettings) -> Path:
    """``<run>/eval/<data>[-n<n>-t<T>].jsonl`` for a run, else ``eval-<model>-<data>...`` here."""
    stem = Path(s.data).stem if Path(s.data).suffix else Path(s.data).name
    suffix = "" if s.n == 1 and s.temperature == 0 else f"-n{s.n}-t{s.temperature:g}"
    if model.run is not None:
        return model.run.dir / "eval" / f"{stem}{suffix}.jsonl"
    name = re.sub(r"[^\w.-]+", "_", Path(model.label).name or model.label).strip("_")
    return Path(f"eval-{name}-{stem}{suffix}.jsonl")


def summary_path(out: Path) -> Path:
    return out.with_name(out.name.removesuffix(".jsonl") + ".summary.json")


def _write_results(out: Path, prompts: list[Prompt], samples: list[Sample], tokenizer: Any) -> None:
    by_prompt: dict[int, list[Sample]] = {}
    for sample in samples:
        by_prompt.setdefault(sample.group, []).append(sample)
    lines = []
    for p in prompts:
        group = by_prompt[p.index]
        record = {
            "index": p.index,
            "prompt": tokenizer.decode(p.prompt_ids),
            "answer": p.row.get("answer"),
            "responses": [
                tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in group
            ],
            "rewards": [s.reward for s in group],
            "correct": [s.reward_info.get("correct") for s in group],
            "lengths": [len(s.response_ids) for s in group],
            "finish_reasons": [s.finish_reason for s in group],
            "num_correct": sum(s.reward_info.get("correct") is True for s in group),
        }
        errors = [s.reward_info.get("error") for s in group]
        if any(e is not None for e in errors):
            record["reward_errors"] = errors
        lines.append(json.dumps(record, ensure_ascii=False, default=str))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "\n".join(lines) + "\n")
    except OSError as err:
        raise UsageError(f"cannot write {out}: {err.strerror or err}.") from None
