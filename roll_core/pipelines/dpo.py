"""`roll dpo`: direct preference optimisation (DPO, IPO, cDPO) against a frozen reference.

The driver loop::

    ref = reference.log_probs(pairs the run uses)      # once, before step 1; cached in the run
    for step in run.steps(max_steps):                  # resumes after the saved step
        pairs = next(loader)                           # loader position is checkpointed
        batch = collate_pairs(pairs) + ref[pairs]      # rows chosen_0, rejected_0, chosen_1, ...
        metrics = actor_train.train_step(batch, "dpo") # loss, rewards, margin, accuracy
        if eval due:    metrics |= evaluate()          # the same on held-out pairs
        tracking.log(step, metrics)
        if save due:    checkpoint(step)
    export final model (merged when LoRA)

The reference policy is the starting model. Without LoRA a `Reference` worker loads a frozen
copy, computes the summed response log-probs of the pairs this run will use (every eval pair,
the train pairs of steps 1..max_steps) and is dropped before training, so training holds one
model. Under `actor_train.lora` the policy itself computes them with its adapters disabled: no
second copy at all. The values go to the run's checksummed `reference_logps.safetensors`
(roll_core/pipelines/dpo_reference.py) so a resumed run does not recompute them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from roll_core.backends.train.torch_backend import resolve_device
from roll_core.config.preference import DPOConfig
from roll_core.data import Batch, StatefulLoader, load_rows, require_columns
from roll_core.data.preference import Pair, build_preference_dataset, collate_pairs, prompt_ids
from roll_core.engine import Cluster, make_executor
from roll_core.models import load_tokenizer, resolve_model_path
from roll_core.models.lora import check_lora_targets_from_config
from roll_core.pipelines.common import (
    DriverLoop,
    RolePlan,
    actor_loader_state,
    evaluate_exact_match,
)
from roll_core.pipelines.dpo_reference import (
    REFERENCE_CACHE,
    fill_reference,
    fingerprint,
    first_uses,
    missing,
    read_cache,
    timed,
    write_cache,
)
from roll_core.workers.actor_train import ActorTrain
from roll_core.workers.reference import Reference


def plan(cfg: DPOConfig) -> list[RolePlan]:
    """Roles, workers and devices this recipe asks for (no model is loaded)."""
    role = cfg.actor_train
    pairs = cfg.trainer.global_batch_size(role.world_size)
    rows = [
        RolePlan(
            role="actor_train",
            worker="ActorTrain",
            backend=role.backend,
            world_size=role.world_size,
            device=role.device,
            executor=cfg.executor.type,
            detail=f"{pairs} pairs ({2 * pairs} sequences) per step"
            + (f"; LoRA rank {role.lora.rank}" if role.lora else ""),
        )
    ]
    if role.lora is None:
        rows.append(
            RolePlan(
                role="reference",
                worker="Reference",
                backend="torch",
                world_size=1,
                device=role.device,
                executor=cfg.executor.type,
                detail="frozen copy of model.path; log-probs once, then released",
            )
        )
    else:
        rows.append(
            RolePlan(
                role="reference",
                worker="ActorTrain",
                backend=role.backend,
                world_size=role.world_size,
                device=role.device,
                executor=cfg.executor.type,
                detail="the policy with its LoRA adapters disabled (no second model)",
            )
        )
    return rows


@dataclass
class DPOData:
    train: list[Pair]
    eval: list[Pair]
    eval_prompts: list[list[int]]
    eval_answers: list[str]
    stats: dict[str, int]
    eval_stats: dict[str, int]


@dataclass
class DPOSetup:
    """What `prepare` checks and builds before a run directory exists."""

    model_path: str
    tokenizer_path: str
    tokenizer: Any
    data: DPOData


def prepare(cfg: DPOConfig) -> DPOSetup:
    """Resolve the model, check LoRA targets, tokenise the pairs: bad input fails here,
    before a run directory is created."""
    if cfg.executor.type == "local" and cfg.actor_train.device == "cuda":
        resolve_device("cuda")
    model_path = resolve_model_path(cfg.model.path)
    tok_path = resolve_model_path(cfg.model.tokenizer) if cfg.model.tokenizer else model_path
    if cfg.actor_train.lora is not None:
        check_lora_targets_from_config(model_path, cfg.actor_train.lora.target_modules)
    tokenizer = load_tokenizer(tok_path)
    return DPOSetup(model_path, tok_path, tokenizer, prepare_data(cfg, tokenizer))


def prepare_data(cfg: DPOConfig, tokenizer: Any) -> DPOData:
    d = cfg.data
    keys: dict[str, Any] = dict(
        fmt=d.format,
        max_length=d.max_length,
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
    )
    rows = load_rows(
        d.train.path, split=d.train.split, subset=d.train.subset, max_rows=d.train.max_rows
    )
    train, stats = build_preference_dataset(rows, tokenizer, what="the DPO training data", **keys)
    data = DPOData(train, [], [], [], stats, {})
    if d.eval is None:
        return data
    limits = [x for x in (d.eval.max_rows, cfg.eval.max_samples) if x is not None]
    erows = load_rows(
        d.eval.path,
        split=d.eval.split,
        subset=d.eval.subset,
        max_rows=min(limits) if limits else None,
        key="data.eval.path",
    )
    data.eval, data.eval_stats = build_preference_dataset(
        erows, tokenizer, what="the DPO eval data", **keys
    )
    if cfg.eval.exact_match:
        answer_key = cfg.eval.answer_key
        if answer_key is not None:
            require_columns(erows, [answer_key], what="the eval data (eval.answer_key)")
        for row in erows:
            data.eval_prompts.append(
                prompt_ids(
                    tokenizer, row, fmt=d.format, prompt_key=d.prompt_key, chosen_key=d.chosen_key
                )
            )
            answer = row[answer_key] if answer_key else row[d.chosen_key]
            if isinstance(answer, list):  # messages: the chosen assistant answer
                answer = answer[-1]["content"]
            data.eval_answers.append(str(answer).strip())
    return data


def reference_log_probs(
    cfg: DPOConfig, setup: DPOSetup, executor: Any, actor: Cluster, loop: DriverLoop
) -> dict[str, torch.Tensor]:
    """Summed response log-probs under the reference policy (roll_core/pipelines/
    dpo_reference.py): ``train`` ``[2 * pairs]`` (NaN for pairs this run never uses) and
    ``eval``, rows chosen_i, rejected_i; read from the run's checksummed cache when it has
    them, the missing ones computed (only the pairs of steps 1..max_steps)."""
    data = setup.data
    steps = list(
        first_uses(
            len(data.train),
            cfg.trainer.global_batch_size(cfg.actor_train.world_size),
            seed=cfg.seed,
            shuffle=cfg.data.shuffle,
            max_steps=cfg.trainer.max_steps,
        )
    )
    fp = fingerprint(data.train + data.eval)
    cache = loop.run.dir / REFERENCE_CACHE
    cached, why = read_cache(cache, fp)
    if why:
        loop.console.print(f"[yellow]reference log-probs: {why}.[/yellow]")
    todo = missing(cached, steps, len(data.eval))
    if cached is not None and todo == 0:
        loop.console_note(f"reference log-probs: read from {cache.name}")
        return cached
    role = cfg.actor_train
    ref: Cluster | None = None
    if role.lora is None:
        ref = Cluster(
            "reference",
            Reference,
            executor,
            resources={"CPU": 1} if cfg.executor.type == "ray" else {},
            worker_kwargs=dict(
                model_path=setup.model_path,
                device=role.device,
                micro_batch_size=2 * cfg.trainer.micro_batch_size,
                num_threads=role.num_threads,
            ),
        )
        ref.run("setup")
    scorer = ref if ref is not None else actor
    method = "log_probs" if ref is not None else "reference_log_probs"
    (out, scored), seconds = timed(
        lambda: fill_reference(
            cached,
            train=data.train,
            eval_pairs=data.eval,
            steps=steps,
            batch_size=cfg.eval.batch_size,
            pad_id=setup.tokenizer.pad_token_id,
            compute=lambda batch: scorer.run_rank0(method, batch),
        )
    )
    write_cache(cache, out, fp)
    loop.console_note(
        f"reference log-probs: {scored} pairs in {seconds:.1f}s (the {len(data.eval)} eval "
        f"pairs and the train pairs of steps 1-{cfg.trainer.max_steps}, not all "
        f"{len(data.train)}) "
        + ("(policy with adapters disabled)" if role.lora else "(frozen copy, now released)")
    )
    return out


def _pair_batch(pairs: list[Pair], ref: torch.Tensor, pad_id: int) -> Batch:
    batch = collate_pairs(pairs, pad_id=pad_id)
    batch["ref_logps"] = ref
    batch.meta["pairs"] = len(pairs)
    return batch


def _interleaved(ref: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """Reference values of pairs ``indices``: rows chosen_i, rejected_i of each, in order."""
    rows = [r for i in indices for r in (2 * i, 2 * i + 1)]
    return ref[torch.tensor(rows, dtype=torch.long)]


def summarise(sums: dict[str, float], prefix: str) -> dict[str, float]:
    """Per-pair means of the `dpo` objective's metric sums, named `prefix/...`."""
    n = max(1.0, sums["dpo/pairs"])
    return {
        f"{prefix}/loss": sums["dpo/loss_sum"] / n,
        f"{prefix}/rewards/chosen": sums["dpo/rewards_chosen_sum"] / n,
        f"{prefix}/rewards/rejected": sums["dpo/rewards_rejected_sum"] / n,
        f"{prefix}/rewards/margin": sums["dpo/margin_sum"] / n,
        f"{prefix}/rewards/accuracy": sums["dpo/accuracy_sum"] / n,
        f"{prefix}/logp_accuracy": sums["dpo/logp_accuracy_sum"] / n,
        f"{prefix}/logps/chosen": sums["dpo/logps_chosen_sum"] / n,
        f"{prefix}/logps/rejected": sums["dpo/logps_rejected_sum"] / n,
        f"{prefix}/nll/chosen": sums["dpo/nll_sum"] / n,
    }


def _sum_results(out: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for result in out:
        for key, value in result.items():
            total[key] = total.get(key, 0.0) + value
    return total


def run(cfg: DPOConfig, setup: DPOSetup, loop: DriverLoop) -> dict[str, float]:
    """Train `cfg` inside the run `loop` manages (fresh or resumed); returns final metrics."""
    data, tokenizer = setup.data, setup.tokenizer
    role = cfg.actor_train
    global_pairs = cfg.trainer.global_batch_size(role.world_size)
    loader = StatefulLoader(len(data.train), global_pairs, seed=cfg.seed, shuffle=cfg.data.shuffle)
    st = data.stats
    loop.console_note(
        f"data: {st['rows']} rows, {len(data.train)} pairs used ({st['skipped_identical']} "
        f"skipped: chosen == rejected; {st['dropped_too_long']} longer than data.max_length "
        f"dropped); eval {len(data.eval)} pairs"
    )
    executor = make_executor(
        cfg.executor.type, address=cfg.executor.ray_address, num_cpus=cfg.executor.num_cpus
    )
    actor = Cluster(
        "actor_train",
        ActorTrain,
        executor,
        world_size=role.world_size,
        resources={"CPU": 1} if cfg.executor.type == "ray" else {},
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
                micro_batch_size=2 * cfg.trainer.micro_batch_size,  # whole pairs per micro-batch
                seed=cfg.seed,
                num_threads=role.num_threads,
                gradient_checkpointing=cfg.model.gradient_checkpointing,
                lora=role.lora,
            ),
        },
    )
    try:
        with loop.phase("loading model (actor_train)"):
            info = actor.run("setup")[0]
        loop.console_note(
            f"actor_train: {info['params']:,} parameters ({info['trainable']:,} trained) "
            f"on {info['device']}"
        )
        with loop.phase("reference log-probs"):
            ref = reference_log_probs(cfg, setup, executor, actor, loop)
        params = dict(
            loss_type=cfg.dpo.loss,
            beta=cfg.dpo.beta,
            label_smoothing=cfg.dpo.label_smoothing,
            sft_weight=cfg.dpo.sft_weight,
        )
        pad_id = tokenizer.pad_token_id
        ref_eval_acc = (
            float((ref["eval"][0::2] > ref["eval"][1::2]).float().mean()) if data.eval else 0.0
        )

        save_state, load_state = actor_loader_state(
            actor, loader, size=len(data.train), unit="pairs"
        )

        def evaluate(step: int) -> dict[str, float]:
            sums: dict[str, float] = {}
            bs = cfg.eval.batch_size
            for i in range(0, len(data.eval), bs):
                pairs = data.eval[i : i + bs]
                batch = _pair_batch(pairs, ref["eval"][2 * i : 2 * (i + len(pairs))], pad_id)
                part = _sum_results(actor.run_dp("evaluate", batch, objective="dpo", **params))
                sums = _sum_results([sums, part])
            metrics = summarise(sums, "eval")
            metrics["eval/ref_logp_accuracy"] = ref_eval_acc
            if cfg.eval.exact_match and data.eval_prompts:
                metrics["eval/exact_match"] = evaluate_exact_match(
                    lambda p: actor.run_rank0(
                        "generate", p, max_new_tokens=cfg.eval.max_new_tokens
                    ),
                    data.eval_prompts,
                    data.eval_answers,
                    tokenizer,
                    batch_size=bs,
                )
            return metrics

        start = loop.begin(save_state=save_state, load_state=load_state)
        if data.eval and not loop.resume:  # the starting point of every eval curve
            loop.log_eval(0, lambda: evaluate(0))
        for step in loop.steps(start, cfg.trainer.max_steps):
            t0 = time.perf_counter()
            indices = next(loader)
            batch = _pair_batch(
                [data.train[i] for i in indices], _interleaved(ref["train"], indices), pad_id
            )
            out = actor.run_dp("train_step", batch, objective="dpo", **params)
            wall = time.perf_counter() - t0
            metrics = {
                **summarise(_sum_results(out), "train"),
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
