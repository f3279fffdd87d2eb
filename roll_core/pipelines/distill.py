"""`roll distill`: a student learns a frozen teacher's next-token distributions.

The driver loop::

    for step in run.steps(max_steps):                     # resumes after the saved step
        batch = collate(next(loader))                     # prompts + responses (SFT formats)
        batch += teacher.targets(batch)                   # p_teacher at response positions
        metrics = actor_train.train_step(batch, "distill")  # divergence(p_teacher, q_student)
        if eval due:  metrics |= evaluate()               # held-out KL, agreement, exact match
        tracking.log(step, metrics)
        if save due:  checkpoint(step)
    export final student (merged when LoRA)

The teacher and the student may differ in size; they must share one tokenizer, which
`prepare` checks before a run directory exists. Logits past the tokenizer's size (embedding
padding, which differs between model sizes) are dropped on both sides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import torch

from roll_core.backends.train.torch_backend import resolve_device
from roll_core.config.preference import DistillConfig
from roll_core.data import Batch, StatefulLoader, collate_sft
from roll_core.engine import Cluster, make_executor
from roll_core.errors import ConfigError, ModelError
from roll_core.models import load_tokenizer, model_summary, resolve_model_path
from roll_core.models.lora import check_lora_targets_from_config
from roll_core.pipelines.common import (
    DriverLoop,
    RolePlan,
    actor_loader_state,
    evaluate_exact_match,
)
from roll_core.pipelines.sft import SFTData
from roll_core.pipelines.sft import prepare_data as prepare_sft_data
from roll_core.workers.actor_train import ActorTrain
from roll_core.workers.teacher import Teacher

FULL_VOCAB_LIMIT_BYTES = 4 << 30
"""Teacher targets of one step above this size need `distill.top_k` (checked in `prepare`)."""


def plan(cfg: DistillConfig) -> list[RolePlan]:
    """Roles, workers and devices this recipe asks for (no model is loaded)."""
    role = cfg.actor_train
    k = cfg.distill.top_k
    return [
        RolePlan(
            role="actor_train",
            worker="ActorTrain",
            backend=role.backend,
            world_size=role.world_size,
            device=role.device,
            executor=cfg.executor.type,
            detail=f"student {cfg.model.path}; global batch "
            f"{cfg.trainer.global_batch_size(role.world_size)}"
            + (f"; LoRA rank {role.lora.rank}" if role.lora else ""),
        ),
        RolePlan(
            role="teacher",
            worker="Teacher",
            backend="torch",
            world_size=1,
            device=role.device,
            executor=cfg.executor.type,
            detail=f"frozen {cfg.teacher.path}; {cfg.distill.loss}, "
            + (f"top-{k} + tail" if k else "full vocabulary"),
        ),
    ]


def check_same_vocabulary(student_tok: Any, teacher_tok: Any, *, student: str, teacher: str) -> int:
    """The shared vocabulary size; a ModelError when the two tokenizers differ."""
    s, t = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s != t:
        differ = sorted(tok for tok in s.keys() | t.keys() if s.get(tok) != t.get(tok))
        shown = ", ".join(repr(x) for x in differ[:3])
        raise ModelError(
            f"the teacher ({teacher}) and the student ({student}) have different tokenizers: "
            f"{len(t)} and {len(s)} tokens, {len(differ)} of them with different ids (e.g. "
            f"{shown}). Distillation compares the two next-token distributions token by "
            "token, so both models need one vocabulary.",
            hint="Pick a teacher and a student of one model family (e.g. Qwen2.5-7B-Instruct "
            "and Qwen2.5-1.5B-Instruct), or point teacher.tokenizer / model.tokenizer at the "
            "right tokenizer.",
        )
    return len(student_tok)


@dataclass
class DistillSetup:
    """What `prepare` checks and builds before a run directory exists."""

    model_path: str
    tokenizer_path: str
    tokenizer: Any
    data: SFTData
    teacher_path: str
    teacher_tokenizer: str
    vocab_size: int


def prepare(cfg: DistillConfig) -> DistillSetup:
    """Resolve both models, check the shared vocabulary, LoRA targets and the memory of the
    teacher's targets, and tokenise the data: bad input fails before a run directory exists."""
    if cfg.executor.type == "local" and cfg.actor_train.device == "cuda":
        resolve_device("cuda")
    model_path = resolve_model_path(cfg.model.path)
    tok_path = resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path
    teacher_path = resolve_model_path(cfg.teacher.path)
    teacher_tok = (
        resolve_model_path(cfg.teacher.tokenizer) if cfg.teacher.tokenizer else teacher_path
    )
    tokenizer = load_tokenizer(tok_path)
    vocab = check_same_vocabulary(
        tokenizer, load_tokenizer(teacher_tok), student=cfg.model.path, teacher=cfg.teacher.path
    )
    for who, path in (("model", cfg.model.path), ("teacher", cfg.teacher.path)):
        rows = model_summary(path).get("vocab_size")
        if rows is not None and rows < vocab:
            raise ModelError(
                f"{who}.path {path} has {rows} output rows but its tokenizer has {vocab} tokens.",
                hint=f"Point {who}.tokenizer at the tokenizer the model was trained with.",
            )
    if cfg.distill.top_k is None:
        rows_per_step = cfg.trainer.global_batch_size(cfg.actor_train.world_size)
        size = rows_per_step * cfg.data.max_length * vocab * 4
        if size > FULL_VOCAB_LIMIT_BYTES:
            raise ConfigError(
                f"distill.top_k is not set: the teacher's full distributions for one step "
                f"({rows_per_step} rows x {cfg.data.max_length} tokens x {vocab} vocabulary) "
                f"take {size / 2**30:.0f} GiB.",
                hint="Set distill.top_k (e.g. 64): the teacher then sends its 64 most likely "
                "tokens and the rest of its mass per position.",
            )
    if cfg.actor_train.lora is not None:
        check_lora_targets_from_config(model_path, cfg.actor_train.lora.target_modules)
    # `data` and `eval` are the SFT sections: the SFT pipeline's data preparation applies.
    data = prepare_sft_data(cast(Any, cfg), tokenizer)
    return DistillSetup(model_path, tok_path, tokenizer, data, teacher_path, teacher_tok, vocab)


def _sum(out: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for result in out:
        for key, value in result.items():
            total[key] = total.get(key, 0.0) + value
    return total


def summarise(sums: dict[str, float], prefix: str) -> dict[str, float]:
    """Per-token means of the `distill` objective's metric sums, named `prefix/...`."""
    n = max(1.0, sums["distill/tokens"])
    return {
        f"{prefix}/loss": sums["distill/loss_sum"] / n,
        f"{prefix}/kl": sums["distill/kl_sum"] / n,
        f"{prefix}/agreement": sums["distill/agree_sum"] / n,
    }


def run(cfg: DistillConfig, setup: DistillSetup, loop: DriverLoop) -> dict[str, float]:
    """Train `cfg` inside the run `loop` manages (fresh or resumed); returns final metrics."""
    data, tokenizer = setup.data, setup.tokenizer
    role = cfg.actor_train
    world = role.world_size
    loader = StatefulLoader(
        len(data.train),
        cfg.trainer.global_batch_size(world),
        seed=cfg.seed,
        shuffle=cfg.data.shuffle,
    )
    loop.console_note(
        f"data: {data.stats['rows']} rows, {len(data.train)} used "
        f"({data.stats.get('dropped_too_long', 0)} longer than data.max_length dropped); "
        f"eval {len(data.eval)} rows"
    )
    executor = make_executor(
        cfg.executor.type, address=cfg.executor.ray_address, num_cpus=cfg.executor.num_cpus
    )
    resources = {"CPU": 1} if cfg.executor.type == "ray" else {}
    actor = Cluster(
        "actor_train",
        ActorTrain,
        executor,
        world_size=world,
        resources=resources,
        worker_kwargs={
            "backend": role.backend,
            "backend_kwargs": dict(
                model_path=setup.model_path,
                tokenizer_path=setup.tokenizer_path,
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
            ),
        },
    )
    teacher = Cluster(
        "teacher",
        Teacher,
        executor,
        resources=resources,
        worker_kwargs=dict(
            model_path=setup.teacher_path,
            tokenizer_path=setup.teacher_tokenizer,
            dtype=cfg.teacher.dtype,
            device=role.device,
            precision=role.precision,
            micro_batch_size=cfg.trainer.micro_batch_size,
            num_threads=role.num_threads,
        ),
    )
    try:
        with loop.phase("loading models (actor_train, teacher)"):
            info = actor.run("setup")[0]
            tinfo = teacher.run("setup")[0]
        loop.console_note(
            f"actor_train (student): {info['params']:,} parameters ({info['trainable']:,} "
            f"trained) on {info['device']}; teacher: {tinfo['params']:,} parameters"
        )
        d = cfg.distill
        vocab = setup.vocab_size
        objective = dict(
            objective="distill",
            loss_type=d.loss,
            skew_alpha=d.skew_alpha,
            jsd_beta=d.jsd_beta,
            vocab_size=vocab,
        )
        teacher_em: list[float] = []  # the teacher never changes: its exact match is computed once

        def with_targets(batch: Batch, temperature: float) -> Batch:
            parts = teacher.run_dp(
                "targets", batch, temperature=temperature, top_k=d.top_k, vocab_size=vocab
            )
            for key in parts[0]:
                batch[key] = torch.cat([p[key] for p in parts])
            return batch

        save_state, load_state = actor_loader_state(
            actor, loader, size=len(data.train), unit="examples"
        )

        def evaluate(step: int) -> dict[str, float]:
            return _evaluate(
                cfg, data, actor, teacher, tokenizer, with_targets, objective, teacher_em
            )

        start = loop.begin(save_state=save_state, load_state=load_state)
        if data.eval and not loop.resume:  # the starting point of every eval curve
            loop.log_eval(0, lambda: evaluate(0))
        pad_id = tokenizer.pad_token_id
        for step in loop.steps(start, cfg.trainer.max_steps):
            t0 = time.perf_counter()
            batch = collate_sft([data.train[i] for i in next(loader)], pad_id=pad_id)
            batch.meta["loss_tokens"] = int(batch.tensors["loss_mask"][:, 1:].sum())
            batch = with_targets(batch, d.temperature)
            out = actor.run_dp("train_step", batch, temperature=d.temperature, **objective)
            wall = time.perf_counter() - t0
            metrics = {
                **summarise(_sum(out), "train"),
                "train/grad_norm": out[0]["train/grad_norm"],
                "train/lr": out[0]["train/lr"],
                "train/epoch": float(loader.epoch),
                "perf/tokens_per_s": sum(o["perf/tokens"] for o in out) / wall,
                "perf/step_s": wall,
            }
            loop.end_step(step, metrics, evaluate=evaluate if data.eval else None)
        final = loop.finish(export=lambda p: actor.run_rank0("export", str(p)))
        final["state_digest"] = actor.run_rank0("state_digest")
        return final
    finally:
        executor.shutdown()


def _evaluate(
    cfg: DistillConfig,
    data: SFTData,
    actor: Cluster,
    teacher: Cluster,
    tokenizer: Any,
    with_targets: Any,
    objective: dict[str, Any],
    teacher_em: list[float],
) -> dict[str, float]:
    """Held-out divergence, KL and agreement at temperature 1, and exact match of both models."""
    sums: dict[str, float] = {}
    bs = cfg.eval.batch_size
    for i in range(0, len(data.eval), bs):
        batch = collate_sft(data.eval[i : i + bs], pad_id=tokenizer.pad_token_id)
        batch.meta["loss_tokens"] = 1  # metrics are sums; the loss value itself is unused
        batch = with_targets(batch, 1.0)
        sums = _sum([sums, *actor.run_dp("evaluate", batch, temperature=1.0, **objective)])
    metrics = summarise(sums, "eval")
    if cfg.eval.exact_match and data.eval_prompts:

        def exact_match(worker: Cluster) -> float:
            return evaluate_exact_match(
                lambda p: worker.run_rank0("generate", p, max_new_tokens=cfg.eval.max_new_tokens),
                data.eval_prompts,
                data.eval_answers,
                tokenizer,
                batch_size=bs,
            )

        metrics["eval/exact_match"] = exact_match(actor)
        if not teacher_em:
            teacher_em.append(exact_match(teacher))
        metrics["eval/teacher_exact_match"] = teacher_em[0]
    return metrics
