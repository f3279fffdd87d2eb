"""The one driver loop of the supervised pipelines: sft, dpo and distill.

They differ only in the batch they build from the loader's rows, the objective actor_train
optimises, the metrics they summarise and what they evaluate; each pipeline describes that as
a `Session` and this module runs it::

    actor_train = build_actor_train(cfg)                 # roles.py: backend, options, placement
    session = pipeline.start(executor, actor_train)      # extra roles (teacher, reference)
    for step in run.steps(max_steps):                    # resumes after the saved step
        batch = session.batch(next(loader))              # loader position is checkpointed
        out = actor_train.train_step(batch, **session.objective)
        metrics = session.summarise(out, batch) + grad norm, lr, epoch, throughput
        if eval due:  metrics |= session.evaluate(step)
        tracking.log(step, metrics); if save due: checkpoint(step)
    export final model (merged when LoRA)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from roll_core.backends.train.torch_backend import ROUTER_AUX_METRIC, resolve_device
from roll_core.config.preference import DistillConfig, DPOConfig
from roll_core.config.schema import DatasetSource, RunConfig, SFTConfig
from roll_core.data import Batch, StatefulLoader, load_rows
from roll_core.data.chat import reasoning_format
from roll_core.engine import Cluster
from roll_core.models import load_tokenizer, resolve_model_path, resolve_tokenizer_path
from roll_core.models.loading import is_vision_model
from roll_core.models.vision import load_processor
from roll_core.pipelines import roles
from roll_core.pipelines.common import DriverLoop

SupervisedRecipe = SFTConfig | DPOConfig | DistillConfig
"""The recipes the supervised loop runs."""


@dataclass
class ResolvedModel:
    """The model and tokenizer a supervised recipe starts from, resolved before a run exists."""

    model_path: str
    tokenizer_path: str
    tokenizer: Any
    processor: Any = field(default=None, kw_only=True)
    """A vision-language model's VisionProcessor (None: a text model)."""


def resolve_model(cfg: RunConfig) -> ResolvedModel:
    """Resolve `cfg.model` (and fail on a missing CUDA device) before a run directory exists."""
    if cfg.executor.type == "local" and cfg.actor_train.device == "cuda":
        resolve_device("cuda")  # no CUDA here: fail before a run directory is created
    model_path = resolve_model_path(cfg.model.path)
    tok_path = resolve_tokenizer_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path
    tokenizer = load_tokenizer(tok_path)
    processor = load_processor(model_path, tokenizer) if is_vision_model(model_path) else None
    return ResolvedModel(model_path, tok_path, tokenizer, processor=processor)


def sum_metrics(outs: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise sums of per-rank (or per-batch) metric sums."""
    total: dict[str, float] = {}
    for result in outs:
        for key, value in result.items():
            total[key] = total.get(key, 0.0) + value
    return total


def router_aux_metric(out: dict[str, float]) -> dict[str, float]:
    """`actor/router_aux_loss` of a mixture-of-experts model that returns one (the ranks'
    weighted shares, summed by the cluster call, add up to the step's mean), else nothing."""
    if ROUTER_AUX_METRIC not in out:
        return {}
    return {ROUTER_AUX_METRIC: out[ROUTER_AUX_METRIC]}


def train_rows(cfg: SupervisedRecipe) -> Any:
    """The rows of `data.train`."""
    d = cfg.data.train
    return load_rows(d.path, split=d.split, subset=d.subset, max_rows=d.max_rows)


def eval_rows(cfg: SupervisedRecipe, d: DatasetSource) -> Any:
    """The rows of `data.eval` (`d`; at most `data.eval.max_rows` and `eval.max_samples`)."""
    limits = [x for x in (d.max_rows, cfg.eval.max_samples) if x is not None]
    return load_rows(
        d.path,
        split=d.split,
        subset=d.subset,
        max_rows=min(limits) if limits else None,
        key="data.eval.path",
    )


def exact_match(cluster: Cluster, data: Any, tokenizer: Any, ev: Any) -> float:
    """Fraction of `data.eval_prompts` whose greedy output, decoded and stripped, equals the
    answer in `data.eval_answers`.

    With a reasoning chat template (Qwen3) the answer is the text after the reasoning block
    (``<think>...</think>``, empty or not; an unclosed block is no answer), and the budget is
    `ev.max_new_tokens` plus the tokens of the empty block the template itself writes before an
    answer (4 for Qwen3), which a model trained on that template generates first."""
    prompts, answers, bs = data.eval_prompts, data.eval_answers, ev.batch_size
    vision = getattr(data, "eval_vision", None) or None  # VLM prompts: their images
    reasoning = reasoning_format(tokenizer)
    budget = ev.max_new_tokens + reasoning.preamble_tokens
    hits = 0
    for i in range(0, len(prompts), bs):
        images = {"vision": vision[i : i + bs]} if vision else {}
        outs = cluster.generate(prompts[i : i + bs], max_new_tokens=budget, **images)
        for out, ref in zip(outs, answers[i : i + bs], strict=True):
            text = reasoning.answer(tokenizer.decode(out, skip_special_tokens=True))
            hits += text.strip() == ref
    return hits / max(1, len(prompts))


@dataclass
class Session:
    """What one supervised pipeline adds to the loop, once actor_train is set up."""

    batch: Callable[[list[int]], Batch]
    """The training batch of the loader's row indices."""
    summarise: Callable[[dict[str, float], Batch], dict[str, float]]
    """`train/...` metrics from train_step's metrics on that batch (the ranks', reduced)."""
    objective: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `ActorTrain.train_step` (the objective and its parameters)."""
    evaluate: Callable[[int], dict[str, float]] | None = None
    """Held-out metrics at a step (None: the recipe has no eval data)."""
    eval_at_start: bool = False
    """Also evaluate before step 1 of a new run (the start of every eval curve)."""


class StartSession(Protocol):
    def __call__(self, executor: Any, actor: Cluster, info: dict[str, Any]) -> Session: ...


def run_supervised(
    cfg: SupervisedRecipe,
    loop: DriverLoop,
    model: ResolvedModel,
    *,
    train_size: int,
    unit: str,
    micro_batch_size: int,
    start: StartSession,
) -> dict[str, float]:
    """Train `cfg` inside the run `loop` manages (fresh or resumed); returns final metrics.

    `train_size` rows of `unit` (examples, pairs) are drawn `trainer.global_batch_size` at a
    time; actor_train runs `micro_batch_size` sequences per forward pass."""
    loader = StatefulLoader(
        train_size,
        cfg.trainer.global_batch_size(cfg.actor_train.world_size),
        seed=cfg.seed,
        shuffle=cfg.data.shuffle,
    )
    executor = roles.executor_for(cfg)
    try:
        actor = roles.build_actor_train(
            cfg,
            executor,
            plan=loop.plan,
            model_path=model.model_path,
            tokenizer_path=model.tokenizer_path,
            total_steps=cfg.trainer.max_steps,
            micro_batch_size=micro_batch_size,
            run_dir=loop.run.dir,
        )
        with loop.phase("loading model (actor_train)"):
            info = actor.setup()[0]
        session = start(executor, actor, info)

        loop.expect_data(train_size, unit)
        loop.register("actor_train", roles.SavedRole(actor, "actor_train"))
        loop.register("loader", loader)
        first = loop.begin()
        evaluate = session.evaluate
        if evaluate is not None and session.eval_at_start and not loop.resume:
            loop.log_eval(0, lambda: evaluate(0))
        for step in loop.steps(first, cfg.trainer.max_steps):
            t0 = time.perf_counter()
            batch = session.batch(next(loader))
            out = actor.train_step(batch, **session.objective)
            wall = time.perf_counter() - t0
            metrics = {
                **session.summarise(out, batch),
                "train/grad_norm": out["train/grad_norm"],
                "train/lr": out["train/lr"],
                **router_aux_metric(out),
                "train/epoch": float(loader.epoch),
                "perf/tokens_per_s": out["perf/tokens"] / wall,
                "perf/step_s": wall,
            }
            loop.end_step(step, metrics, evaluate=session.evaluate)
        final = loop.finish(export=lambda p: actor.export(str(p)))
        final["state_digest"] = actor.state_digest()
        return final
    finally:
        executor.shutdown()
