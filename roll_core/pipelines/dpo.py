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

from dataclasses import dataclass
from typing import Any

import torch

from roll_core.config.preference import DPOConfig
from roll_core.data import Batch, require_columns
from roll_core.data.preference import Pair, build_preference_dataset, collate_pairs, prompt_ids
from roll_core.engine import Cluster
from roll_core.engine.plan import Plan
from roll_core.models.lora import check_lora_targets_from_config
from roll_core.pipelines import roles
from roll_core.pipelines.common import DriverLoop, RolePlan
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
from roll_core.pipelines.supervised import (
    ResolvedModel,
    Session,
    eval_rows,
    exact_match,
    resolve_model,
    run_supervised,
    sum_metrics,
    train_rows,
)


def plan(cfg: DPOConfig, _plan: Plan) -> list[RolePlan]:
    """Roles, workers and devices this recipe asks for (no model is loaded)."""
    lora = cfg.actor_train.lora
    pairs = cfg.trainer.global_batch_size(cfg.actor_train.world_size)
    detail = f"{pairs} pairs ({2 * pairs} sequences) per step"
    rows = [roles.actor_train_row(cfg, detail + (f"; LoRA rank {lora.rank}" if lora else ""))]
    if lora is None:
        frozen = "frozen copy of model.path; log-probs once, then released"
        return rows + [roles.frozen_row(cfg, "reference", "Reference", frozen)]
    disabled = "the policy with its LoRA adapters disabled (no second model)"
    return rows + [roles.actor_train_row(cfg, disabled, role="reference")]


@dataclass
class DPOData:
    train: list[Pair]
    eval: list[Pair]
    eval_prompts: list[list[int]]
    eval_answers: list[str]
    stats: dict[str, int]
    eval_stats: dict[str, int]


@dataclass
class DPOSetup(ResolvedModel):
    """What `prepare` checks and builds before a run directory exists."""

    data: DPOData


def prepare(cfg: DPOConfig) -> DPOSetup:
    """Resolve the model, check LoRA targets, tokenise the pairs: bad input fails here,
    before a run directory is created."""
    model = resolve_model(cfg)
    if cfg.actor_train.lora is not None:
        check_lora_targets_from_config(model.model_path, cfg.actor_train.lora.target_modules)
    return DPOSetup(**vars(model), data=prepare_data(cfg, model.tokenizer))


def prepare_data(cfg: DPOConfig, tokenizer: Any) -> DPOData:
    d = cfg.data
    keys: dict[str, Any] = dict(
        fmt=d.format,
        max_length=d.max_length,
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
    )
    rows = train_rows(cfg)
    train, stats = build_preference_dataset(rows, tokenizer, what="the DPO training data", **keys)
    data = DPOData(train, [], [], [], stats, {})
    if d.eval is None:
        return data
    erows = eval_rows(cfg, d.eval)
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
        ref = roles.build_reference(
            cfg,
            executor,
            plan=loop.plan,
            model_path=setup.model_path,
            micro_batch_size=2 * cfg.trainer.micro_batch_size,
            tokenizer_path=setup.tokenizer_path,
        )
        ref.setup()
    score = ref.log_probs if ref is not None else actor.reference_log_probs
    (out, scored), seconds = timed(
        lambda: fill_reference(
            cached,
            train=data.train,
            eval_pairs=data.eval,
            steps=steps,
            batch_size=cfg.eval.batch_size,
            pad_id=setup.tokenizer.pad_token_id,
            compute=score,
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


def run(cfg: DPOConfig, setup: DPOSetup, loop: DriverLoop) -> dict[str, float]:
    """Train `cfg` inside the run `loop` manages (fresh or resumed); returns final metrics."""
    data, tokenizer = setup.data, setup.tokenizer
    st = data.stats
    loop.console_note(
        f"data: {st['rows']} rows, {len(data.train)} pairs used ({st['skipped_identical']} "
        f"skipped: chosen == rejected; {st['dropped_too_long']} longer than data.max_length "
        f"dropped); eval {len(data.eval)} pairs"
    )
    pad_id = tokenizer.pad_token_id
    objective = dict(
        objective="dpo",
        loss_type=cfg.dpo.loss,
        beta=cfg.dpo.beta,
        label_smoothing=cfg.dpo.label_smoothing,
        sft_weight=cfg.dpo.sft_weight,
    )

    def start(executor: Any, actor: Cluster, info: dict[str, Any]) -> Session:
        loop.console_note(
            f"actor_train: {info['params']:,} parameters ({info['trainable']:,} trained) "
            f"on {info['device']}"
        )
        with loop.phase("reference log-probs"):
            ref = reference_log_probs(cfg, setup, executor, actor, loop)

        def batch(indices: list[int]) -> Batch:
            pairs = [data.train[i] for i in indices]
            return _pair_batch(pairs, _interleaved(ref["train"], indices), pad_id)

        def evaluate(step: int) -> dict[str, float]:
            return _evaluate(cfg, setup, actor, ref["eval"], objective)

        return Session(
            batch=batch,
            summarise=lambda out, _: summarise(out, "train"),
            objective=objective,
            evaluate=evaluate if data.eval else None,
            eval_at_start=True,
        )

    return run_supervised(
        cfg,
        loop,
        setup,
        train_size=len(data.train),
        unit="pairs",
        micro_batch_size=2 * cfg.trainer.micro_batch_size,  # whole pairs per micro-batch
        start=start,
    )


def _evaluate(
    cfg: DPOConfig, setup: DPOSetup, actor: Cluster, ref: torch.Tensor, objective: dict[str, Any]
) -> dict[str, float]:
    """The objective's metrics on the eval pairs (+ exact match of greedy answers)."""
    data, bs = setup.data, cfg.eval.batch_size
    pad_id = setup.tokenizer.pad_token_id
    sums: dict[str, float] = {}
    for i in range(0, len(data.eval), bs):
        pairs = data.eval[i : i + bs]
        batch = _pair_batch(pairs, ref[2 * i : 2 * (i + len(pairs))], pad_id)
        sums = sum_metrics([sums, actor.evaluate(batch, **objective)])
    metrics = summarise(sums, "eval")
    metrics["eval/ref_logp_accuracy"] = float((ref[0::2] > ref[1::2]).float().mean())
    if cfg.eval.exact_match and data.eval_prompts:
        metrics["eval/exact_match"] = exact_match(actor, data, setup.tokenizer, cfg.eval)
    return metrics
