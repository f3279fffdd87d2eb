"""The RL loop's rollout records (`tracking.rollout_records`, docs/view.md): each step, a few
whole groups of the training batch, as the update sees them, written to the run's
``rollouts/`` (roll_core/tracking/rollouts.py: the file format, atomic step files, the budget,
resume). `roll view` reads them.

A recorded row holds its unpadded token ids and each token's text; per-token values over the
tokens from the first generated one on (``start``; value j belongs to token ``start + j`` and
comes from target position ``start + j - 1``): ``behaviour_lp`` (the sampler's log-prob),
``trainer_lp`` (the trainer's, before the update), ``ref_lp`` / ``teacher_lp`` / ``value``
(the critic's, PPO) when the step has them, ``advantage``, ``mask`` (the loss mask the update
uses), ``generated`` (1 on tokens the model sampled: generated but masked = rejected by rollout
correction or the overlong filter), ``is_weight`` (rollout-correction importance weights) and ``entropy`` (the trainer's,
of each next-token distribution, before the update; None on the megatron backend). Then the row's reward and its parts, group,
policy version and staleness, finish reason, and for agentic rows the episode (env, seed,
status, turns) and its conversation: the row's context and generated spans as text.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from roll_core.config.rlvr import RolloutRecordsConfig
from roll_core.data import Batch
from roll_core.rollout.agentic.batch import EPISODE_ROW
from roll_core.rollout.agentic.episode import Trajectory
from roll_core.rollout.one_turn import Sample
from roll_core.tracking.rollouts import RolloutStore

_TOKEN_FIELDS = {
    "behaviour_lp": "behaviour_log_probs",
    "trainer_lp": "old_log_probs",
    "ref_lp": "ref_log_probs",
    "teacher_lp": "teacher_log_probs",
    "advantage": "advantages",
    "mask": "response_mask",
    "is_weight": "rollout_is_weights",
    "value": "values",
}


class RolloutRecorder:
    """Writes each step's record; built once per run by the RL loop."""

    def __init__(
        self, cfg: RolloutRecordsConfig, run_dir: Path, *, tokenizer: Any, start: int
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.store = RolloutStore(run_dir, max_mb=cfg.max_mb)
        self.store.truncate_after(start)  # a resumed run redoes the steps after `start`
        self.budget_noted = self.store.full

    def pick_rows(self, step: int, batch: Batch) -> list[int]:
        """Whole groups in a step-seeded random order until `samples_per_step` rows are in;
        their rows in batch order."""
        groups = batch.tensors["group_ids"].tolist()
        order = sorted(set(groups))
        random.Random(step).shuffle(order)
        chosen: set[int] = set()
        rows: list[int] = []
        for g in order:
            if len(rows) >= self.cfg.samples_per_step:
                break
            chosen.add(g)
            rows = [i for i, x in enumerate(groups) if x in chosen]
        return rows

    def record(
        self,
        step: int,
        batch: Batch,
        groups: list[list[Any]],
        *,
        trainer_log_probs: Any = None,
    ) -> bool:
        """Write step `step`'s record of `batch` (whose `groups` made it); `trainer_log_probs`:
        a callable giving the trainer's ``log_probs`` and ``entropy`` of a sub-batch (or None),
        its log-probs used when the batch has no ``old_log_probs`` (the update computes them
        itself). False when the budget is spent."""
        if self.store.full:
            return False
        rows = self.pick_rows(step, batch)
        sub = batch.select(rows)
        stats = trainer_log_probs(sub) if trainer_log_probs is not None else None
        if stats is not None:
            if "old_log_probs" not in sub.tensors:
                sub.tensors["old_log_probs"] = stats["log_probs"]
            if "entropy" in stats:
                sub.tensors["token_entropy"] = stats["entropy"]
        items = [s for g in groups for s in g]
        records = [self.row(step, sub, j, batch_row, items) for j, batch_row in enumerate(rows)]
        return self.store.write(step, step_summary(batch, records), records)

    def row(
        self, step: int, sub: Batch, j: int, batch_row: int, items: list[Any]
    ) -> dict[str, Any]:
        """The record of row `j` of the sub-batch (row `batch_row` of the step's batch)."""
        t = sub.tensors
        n = int(t["attention_mask"][j].sum())
        ids = t["input_ids"][j, :n].tolist()
        version = int(t["policy_versions"][j])
        rec: dict[str, Any] = {
            "row": batch_row,
            "group": int(t["group_ids"][j]),
            "reward": float(t["scores"][j]),
            "policy_version": version,
            "staleness": step - 1 - version,  # step s ideally samples from version s - 1
            "length": int(t["response_lengths"][j]),
        }
        if EPISODE_ROW in sub.non_tensors:
            e, part = sub.non_tensors[EPISODE_ROW][j]
            generated = _episode_fields(rec, items[e], part, step_mode="step_episode" in t)
        else:
            generated = _sample_fields(rec, items[batch_row], self.tokenizer)
        start = max(1, next((k for k, g in enumerate(generated) if g), n))
        rec["start"] = start
        rec["ids"] = ids
        rec["tokens"] = _token_texts(self.tokenizer, ids)
        rec["generated"] = generated[start:]
        for name, key in _TOKEN_FIELDS.items():
            value = t.get(key)
            rec[name] = None if value is None else _values(value[j, start - 1 : n - 1])
        entropy = t.get("token_entropy")
        rec["entropy"] = None if entropy is None else _values(entropy[j, start - 1 : n - 1])
        rec["prompt"] = _decode(self.tokenizer, ids[:start])
        rec["response"] = _decode(self.tokenizer, ids[start:])
        if EPISODE_ROW in sub.non_tensors:
            rec["conversation"] = _conversation(self.tokenizer, ids, generated)
        return rec


def step_summary(batch: Batch, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The step file's first line: the batch's size and rewards and the recorded rows'."""
    scores = batch.tensors["scores"]
    return {
        "batch_rows": len(batch),
        "batch_reward_mean": float(scores.mean()),
        "rows": len(records),
        "groups": len({r["group"] for r in records}),
        "reward_mean": sum(r["reward"] for r in records) / max(1, len(records)),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in records)),
        "envs": sorted({r["env"] for r in records}),
        "max_staleness": max((r["staleness"] for r in records), default=0),
    }


def _sample_fields(rec: dict[str, Any], sample: Sample, tokenizer: Any) -> list[int]:
    """An RLVR row's own fields; returns its generated-token mask over the row's ids."""
    p, r = len(sample.prompt.prompt_ids), len(sample.response_ids)
    rec["finish_reason"] = sample.finish_reason
    rec["env"] = str(sample.reward_info.get("domain", ""))
    rec["reward_parts"] = {
        k: v for k, v in sample.reward_info.items() if isinstance(v, (str, int, float, bool))
    }
    rec["prompt_index"] = sample.prompt.index
    rec["prompt_key"] = _key(sample.prompt.prompt_ids)
    return [0] * p + [1] * r


def _episode_fields(
    rec: dict[str, Any], traj: Trajectory, part: int, *, step_mode: bool
) -> list[int]:
    """An agentic row's own fields (the episode, its turns); returns its generated-token
    mask: the segment's trace mask, or the turn's prompt and response (GiGPO's step rows)."""
    if step_mode:
        turn = traj.turns[part]
        generated = [0] * len(turn.prompt_ids) + [1] * len(turn.response_ids)
        rec["finish_reason"] = turn.finish_reason
    else:
        generated = list(traj.traces()[part].mask)
        last = [u for u in traj.turns if u.segment == part]
        rec["finish_reason"] = last[-1].finish_reason if last else traj.status
    rec["env"] = traj.tag
    rec["reward_parts"] = {"turn_rewards": [u.reward for u in traj.turns]}
    rec["prompt_key"] = f"{traj.tag}:{traj.seed}"
    rec["episode"] = {
        "tag": traj.tag,
        "seed": traj.seed,
        "status": traj.status,
        "success": traj.success,
        "return": traj.episode_return,
        "error": traj.error,
        "part": part,
        "parts": len(traj.turns) if step_mode else len(traj.traces()),
        "turns": [
            {
                "action": u.action,
                "reward": u.reward,
                "finish_reason": u.finish_reason,
                "policy_version": u.policy_version,
                "valid": u.action_is_valid,
                "segment": u.segment,
            }
            for u in traj.turns
        ],
    }
    return generated


def _conversation(tokenizer: Any, ids: list[int], generated: list[int]) -> list[dict[str, Any]]:
    """The row as alternating spans: ``context`` (prompts, env observations, tool results,
    as the chat template rendered them) and ``model`` (what the policy generated: its actions
    and tool calls)."""
    spans: list[dict[str, Any]] = []
    begin = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or generated[k] != generated[begin]:
            role = "model" if generated[begin] else "context"
            spans.append({"role": role, "start": begin, "text": _decode(tokenizer, ids[begin:k])})
            begin = k
    return spans


def _values(x: torch.Tensor) -> list[float]:
    return [round(v, 5) for v in x.float().tolist()]


def _key(ids: list[int]) -> str:
    """A short, stable key of a prompt (the same prompt in two runs compares)."""
    return hashlib.blake2b(repr(ids).encode(), digest_size=8).hexdigest()


def _decode(tokenizer: Any, ids: list[int]) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return str(tokenizer.decode(ids, skip_special_tokens=False))


def _token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [str(i) for i in ids]
    return [str(x) for x in tokenizer.batch_decode([[i] for i in ids])]
