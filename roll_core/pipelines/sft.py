"""`roll sft`: supervised fine-tuning, loss on response tokens only.

The driver loop::

    for step in run.steps(max_steps):                 # resumes after the saved step
        batch = collate(next(loader))                 # loader position is checkpointed
        metrics = actor_train.train_step(batch)       # micro-batches, clip, AdamW, LR
        if eval due:    metrics |= evaluate()         # eval loss (+ exact match by generation)
        tracking.log(step, metrics)
        if save due:    checkpoint(step)              # atomic; `latest` written last
    export final model in Hugging Face format
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roll_core.config.schema import SFTConfig
from roll_core.data import (
    Batch,
    build_sft_dataset,
    collate_sft,
    encode_chat,
    encode_prompt,
    require_columns,
)
from roll_core.data.vision import image_rows
from roll_core.engine import Cluster
from roll_core.engine.plan import Plan
from roll_core.pipelines import roles
from roll_core.pipelines.common import DriverLoop, RolePlan
from roll_core.pipelines.supervised import (
    ResolvedModel,
    Session,
    eval_rows,
    exact_match,
    resolve_model,
    run_supervised,
    train_rows,
)


def plan(cfg: SFTConfig, _plan: Plan) -> list[RolePlan]:
    """Roles, workers and devices this recipe asks for (no model is loaded)."""
    t = cfg.trainer
    batch = t.global_batch_size(cfg.actor_train.world_size)
    detail = f"micro_batch {t.micro_batch_size} x accum {t.grad_accum_steps} = global batch {batch}"
    return [roles.actor_train_row(cfg, detail)]


@dataclass
class SFTData:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    eval_prompts: list[list[int]]
    eval_answers: list[str]
    stats: dict[str, int]
    eval_vision: list[Any] = field(default_factory=list)
    """The images of each eval prompt (vision-language models; empty for text data)."""


def prepare_data(cfg: SFTConfig, tokenizer: Any, processor: Any | None = None) -> SFTData:
    """Tokenise the train (and eval) rows; ``processor``: a vision-language model's
    VisionProcessor, which reads the rows' images (``data.image_key``)."""
    d = cfg.data
    keys: dict[str, Any] = dict(
        fmt=d.format,
        prompt_key=d.prompt_key,
        response_key=d.response_key,
        messages_key=d.messages_key,
        max_length=d.max_length,
    )
    rows = train_rows(cfg)
    images = _image_rows(cfg, rows, processor, d.train.path)
    train, stats = build_sft_dataset(rows, tokenizer, **keys, images=images)
    eval_set: list[dict[str, Any]] = []
    prompts: list[list[int]] = []
    vision: list[Any] = []
    answers: list[str] = []
    if d.eval is not None:
        erows = eval_rows(cfg, d.eval)
        eval_images = _image_rows(cfg, erows, processor, d.eval.path)
        eval_set, _ = build_sft_dataset(erows, tokenizer, **keys, images=eval_images)
        if cfg.eval.exact_match:
            if cfg.eval.answer_key is not None:
                require_columns(
                    erows, [cfg.eval.answer_key], what="the eval data (eval.answer_key)"
                )
            if eval_images is not None:  # the kept eval examples hold prompt ids and images
                prompts, vision, answers = _image_exact_match_pairs(cfg, erows, eval_set)
            else:
                prompts, answers = _exact_match_pairs(cfg, erows, tokenizer)
    return SFTData(train, eval_set, prompts, answers, stats, vision)


def _image_rows(cfg: SFTConfig, rows: Any, processor: Any, path: str) -> Any:
    return image_rows(
        rows, column=cfg.data.image_key, processor=processor, data_path=path, model=cfg.model.path
    )


def _image_exact_match_pairs(
    cfg: SFTConfig, rows: Any, examples: list[dict[str, Any]]
) -> tuple[list[list[int]], list[Any], list[str]]:
    """Prompt ids (up to the assistant header), images and answers of the kept image rows."""
    kept = [e for e in examples if "row" in e]
    prompts = [e["input_ids"][: e["loss_mask"].index(1)] for e in kept]
    key = cfg.eval.answer_key or cfg.data.response_key
    answers = [str(rows[e["row"]][key]).strip() for e in kept]
    return prompts, [e.get("vision") for e in kept], answers


def _exact_match_pairs(
    cfg: SFTConfig, rows: Any, tokenizer: Any
) -> tuple[list[list[int]], list[str]]:
    d = cfg.data
    prompts, answers = [], []
    for row in rows:
        if d.format == "messages":
            msgs = row[d.messages_key]
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            context, reference = msgs[:last], msgs[last]["content"]
        else:
            context, reference = (
                [{"role": "user", "content": row[d.prompt_key]}],
                row[d.response_key],
            )
        if cfg.eval.answer_key is not None:
            reference = row[cfg.eval.answer_key]
        prompts.append(_prompt_ids(tokenizer, context))
        answers.append(str(reference).strip())
    return prompts, answers


@dataclass
class SFTSetup(ResolvedModel):
    """What `prepare` checks and builds before a run directory exists."""

    data: SFTData


def prepare(cfg: SFTConfig) -> SFTSetup:
    """Resolve the model and tokenise the data: bad paths fail here, before a run is created."""
    model = resolve_model(cfg)
    return SFTSetup(**vars(model), data=prepare_data(cfg, model.tokenizer, model.processor))


def _prompt_ids(tokenizer: Any, context: list[dict[str, str]]) -> list[int]:
    """Token ids of `context` followed by the assistant generation header."""
    if len(context) == 1 and context[0]["role"] == "user":
        return encode_prompt(tokenizer, context[0]["content"])
    return encode_chat(tokenizer, context, add_generation_prompt=True)


def run(cfg: SFTConfig, setup: SFTSetup, loop: DriverLoop) -> dict[str, float]:
    """Train `cfg` inside the run `loop` manages (fresh or resumed); returns final metrics."""
    data, tokenizer = setup.data, setup.tokenizer
    pad_id = tokenizer.pad_token_id
    loop.console_note(
        f"data: {data.stats['rows']} rows, {len(data.train)} used "
        f"({data.stats.get('dropped_too_long', 0)} longer than data.max_length dropped"
        + (
            f", {data.stats['dropped_bad_image']} with an unreadable image skipped"
            if data.stats.get("dropped_bad_image")
            else ""
        )
        + "); "
        f"eval {len(data.eval)} rows"
    )

    def batch(indices: list[int]) -> Batch:
        batch = collate_sft([data.train[i] for i in indices], pad_id=pad_id)
        batch.meta["loss_tokens"] = int(batch.tensors["loss_mask"][:, 1:].sum())
        return batch

    def summarise(out: dict[str, float], batch: Batch) -> dict[str, float]:
        return {"train/loss": out["train/loss_sum"] / max(1, batch.meta["loss_tokens"])}

    def start(executor: Any, actor: Cluster, info: dict[str, Any]) -> Session:
        loop.console_note(f"actor_train: {info['params']:,} parameters on {info['device']}")
        evaluate = (lambda step: _evaluate(cfg, data, actor, tokenizer)) if data.eval else None
        return Session(batch=batch, summarise=summarise, evaluate=evaluate)

    return run_supervised(
        cfg,
        loop,
        setup,
        train_size=len(data.train),
        unit="examples",
        micro_batch_size=cfg.trainer.micro_batch_size,
        start=start,
    )


def _evaluate(cfg: SFTConfig, data: SFTData, actor: Cluster, tokenizer: Any) -> dict[str, float]:
    loss_sum = 0.0
    loss_tokens = 0.0
    bs = cfg.eval.batch_size
    for i in range(0, len(data.eval), bs):
        batch = collate_sft(data.eval[i : i + bs], pad_id=tokenizer.pad_token_id)
        batch.meta["loss_tokens"] = 1  # metrics are sums; the loss value itself is unused
        if len(batch) < actor.world_size:
            continue  # fewer rows than ranks: not split over them
        out = actor.evaluate(batch)
        loss_sum += out["train/loss_sum"]
        loss_tokens += out["train/loss_tokens"]
    metrics = {"eval/loss": loss_sum / max(1.0, loss_tokens)}
    if cfg.eval.exact_match and data.eval_prompts:
        metrics["eval/exact_match"] = exact_match(actor, data, tokenizer, cfg.eval)
    return metrics
