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

import time
from dataclasses import dataclass
from typing import Any

from roll_core.backends.train.torch_backend import resolve_device
from roll_core.config.schema import SFTConfig
from roll_core.data import (
    StatefulLoader,
    build_sft_dataset,
    collate_sft,
    encode_prompt,
    load_rows,
    require_columns,
)
from roll_core.engine import Cluster, make_executor
from roll_core.engine.resource_plan import cluster_placement
from roll_core.models import load_tokenizer, resolve_model_path
from roll_core.pipelines.common import (
    DriverLoop,
    RolePlan,
    actor_loader_state,
    evaluate_exact_match,
)
from roll_core.workers.actor_train import ActorTrain, backend_options


def plan(cfg: SFTConfig) -> list[RolePlan]:
    """Roles, workers and devices this recipe asks for (no model is loaded)."""
    role = cfg.actor_train
    return [
        RolePlan(
            role="actor_train",
            worker="ActorTrain",
            backend=role.backend,
            world_size=role.world_size,
            device=role.device,
            executor=cfg.executor.type,
            detail=f"micro_batch {cfg.trainer.micro_batch_size} x accum "
            f"{cfg.trainer.grad_accum_steps} = global batch "
            f"{cfg.trainer.global_batch_size(role.world_size)}",
        )
    ]


@dataclass
class SFTData:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    eval_prompts: list[list[int]]
    eval_answers: list[str]
    stats: dict[str, int]


def prepare_data(cfg: SFTConfig, tokenizer: Any) -> SFTData:
    d = cfg.data
    keys: dict[str, Any] = dict(
        fmt=d.format,
        prompt_key=d.prompt_key,
        response_key=d.response_key,
        messages_key=d.messages_key,
        max_length=d.max_length,
    )
    rows = load_rows(
        d.train.path, split=d.train.split, subset=d.train.subset, max_rows=d.train.max_rows
    )
    train, stats = build_sft_dataset(rows, tokenizer, **keys)
    eval_set: list[dict[str, Any]] = []
    prompts: list[list[int]] = []
    answers: list[str] = []
    if d.eval is not None:
        limits = [x for x in (d.eval.max_rows, cfg.eval.max_samples) if x is not None]
        max_rows = min(limits) if limits else None
        erows = load_rows(
            d.eval.path,
            split=d.eval.split,
            subset=d.eval.subset,
            max_rows=max_rows,
            key="data.eval.path",
        )
        eval_set, _ = build_sft_dataset(erows, tokenizer, **keys)
        if cfg.eval.exact_match:
            if cfg.eval.answer_key is not None:
                require_columns(
                    erows, [cfg.eval.answer_key], what="the eval data (eval.answer_key)"
                )
            prompts, answers = _exact_match_pairs(cfg, erows, tokenizer)
    return SFTData(train, eval_set, prompts, answers, stats)


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
class SFTSetup:
    """What `prepare` checks and builds before a run directory exists."""

    model_path: str
    tokenizer_path: str
    tokenizer: Any
    data: SFTData


def prepare(cfg: SFTConfig) -> SFTSetup:
    """Resolve the model and tokenise the data: bad paths fail here, before a run is created."""
    if cfg.executor.type == "local" and cfg.actor_train.device == "cuda":
        resolve_device("cuda")  # no CUDA here: fail before a run directory is created
    model_path = resolve_model_path(cfg.model.path)
    tok_path = resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path
    tokenizer = load_tokenizer(tok_path)
    return SFTSetup(model_path, tok_path, tokenizer, prepare_data(cfg, tokenizer))


def _prompt_ids(tokenizer: Any, context: list[dict[str, str]]) -> list[int]:
    """Token ids of `context` followed by the assistant generation header."""
    if len(context) == 1 and context[0]["role"] == "user":
        return encode_prompt(tokenizer, context[0]["content"])
    out = tokenizer.apply_chat_template(context, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def run(cfg: SFTConfig, setup: SFTSetup, loop: DriverLoop) -> dict[str, float]:
    """Train `cfg` inside the run `loop` manages (fresh or resumed); returns final metrics."""
    data, tokenizer = setup.data, setup.tokenizer
    model_path, tok_path = setup.model_path, setup.tokenizer_path
    world = cfg.actor_train.world_size
    global_batch = cfg.trainer.global_batch_size(world)
    loader = StatefulLoader(len(data.train), global_batch, seed=cfg.seed, shuffle=cfg.data.shuffle)
    loop.console_note(
        f"data: {data.stats['rows']} rows, {len(data.train)} used "
        f"({data.stats.get('dropped_too_long', 0)} longer than data.max_length dropped); "
        f"eval {len(data.eval)} rows"
    )

    executor = make_executor(
        cfg.executor.type, address=cfg.executor.ray_address, num_cpus=cfg.executor.num_cpus
    )
    role = cfg.actor_train
    actor = Cluster(
        "actor_train",
        ActorTrain,
        executor,
        world_size=world,
        resources={"CPU": 1} if cfg.executor.type == "ray" else {},
        **cluster_placement(cfg, "actor_train"),
        worker_kwargs={
            "backend": role.backend,
            "backend_kwargs": dict(
                model_path=model_path,
                tokenizer_path=tok_path,
                dtype=cfg.model.dtype,
                device=role.device,
                precision=role.precision,
                optim=role.optim,
                total_steps=cfg.trainer.max_steps,
                micro_batch_size=cfg.trainer.micro_batch_size,
                seed=cfg.seed,
                num_threads=role.num_threads,
                gradient_checkpointing=cfg.model.gradient_checkpointing,
                lora=role.lora,
                **backend_options(role),
            ),
        },
    )
    try:
        with loop.phase("loading model (actor_train)"):
            info = actor.run("setup")[0]
        loop.console_note(f"actor_train: {info['params']:,} parameters on {info['device']}")

        save_state, load_state = actor_loader_state(
            actor, loader, size=len(data.train), unit="examples"
        )

        def evaluate(step: int) -> dict[str, float]:
            return _evaluate(cfg, data, actor, tokenizer)

        start = loop.begin(save_state=save_state, load_state=load_state)
        pad_id = tokenizer.pad_token_id
        for step in loop.steps(start, cfg.trainer.max_steps):
            t0 = time.perf_counter()
            batch = collate_sft([data.train[i] for i in next(loader)], pad_id=pad_id)
            loss_tokens = int(batch.tensors["loss_mask"][:, 1:].sum())
            batch.meta["loss_tokens"] = loss_tokens
            out = actor.run_dp("train_step", batch)
            wall = time.perf_counter() - t0
            tokens = sum(o["perf/tokens"] for o in out)
            metrics = {
                "train/loss": sum(o["train/loss_sum"] for o in out) / max(1, loss_tokens),
                "train/grad_norm": out[0]["train/grad_norm"],
                "train/lr": out[0]["train/lr"],
                "train/epoch": float(loader.epoch),
                "perf/tokens_per_s": tokens / wall,
                "perf/step_s": wall,
            }
            loop.end_step(step, metrics, evaluate=evaluate if data.eval else None)
        final = loop.finish(export=lambda p: actor.run_rank0("export", str(p)))
        final["state_digest"] = actor.run_rank0("state_digest")
        return final
    finally:
        executor.shutdown()


def _evaluate(cfg: SFTConfig, data: SFTData, actor: Cluster, tokenizer: Any) -> dict[str, float]:
    loss_sum = 0.0
    loss_tokens = 0.0
    bs = cfg.eval.batch_size
    for i in range(0, len(data.eval), bs):
        batch = collate_sft(data.eval[i : i + bs], pad_id=tokenizer.pad_token_id)
        batch.meta["loss_tokens"] = 1  # metrics are sums; the loss value itself is unused
        out = actor.run_dp("evaluate", batch) if len(batch) >= actor.world_size else []
        loss_sum += sum(o["train/loss_sum"] for o in out)
        loss_tokens += sum(o["train/loss_tokens"] for o in out)
    metrics = {"eval/loss": loss_sum / max(1.0, loss_tokens)}
    if cfg.eval.exact_match and data.eval_prompts:
        metrics["eval/exact_match"] = evaluate_exact_match(
            lambda prompts: actor.run_rank0(
                "generate", prompts, max_new_tokens=cfg.eval.max_new_tokens
            ),
            data.eval_prompts,
            data.eval_answers,
            tokenizer,
            batch_size=bs,
        )
    return metrics
