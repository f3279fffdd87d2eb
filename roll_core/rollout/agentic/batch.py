"""Trajectories -> the training Batch, in the two paradigms, plus episode metrics.

* trajectory-wise (StarPO, Wang et al. 2025, arXiv 2504.20073): one row per episode, the whole
  token trace (first prompt, every generated response, every env reply). ``response_mask`` is
  1 only on generated tokens; ``scores`` is the episode return.
* step-wise (GiGPO, arXiv 2505.10978): one row per turn, the prompt the model saw (system,
  a bounded window of earlier turns, the observation) and the response it generated.
  Per-row ``step_returns`` (discounted return from that turn), ``step_episode`` (row of its
  episode in ``episode_returns``) and ``anchor_ids`` (same env group and same env state) feed
  :func:`roll_core.algorithms.gigpo.gigpo_advantages`.

Layout as in rollout/batch.py: ``input_ids`` [B, T] right-padded; per-token fields in target
space [B, T-1] (position t scores token t+1). Rows with images (vision-language models) carry
their ``pixel_values`` / ``image_grid_thw`` as per-row non-tensor fields
(:mod:`roll_core.data.vision`): a trajectory row every image of its episode, a step row the
images of its prompt, the very inputs its turns were generated from.

Only what the model generated into is trained: a row without a generated token, or longer than
the context the recipe allows, is left out and counted (``rollout/rows_dropped_*``); the
episode loops never make one, so this is the last line of defence.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from roll_core.algorithms.gigpo import discounted_step_returns
from roll_core.data import Batch
from roll_core.data.vision import vision_fields
from roll_core.errors import RollError
from roll_core.models.routing import ROUTES_KEY, routes_tensor
from roll_core.rollout.agentic.episode import Trajectory


def _rows(
    sequences: list[tuple[list[int], list[int], list[float]]], pad_id: int
) -> dict[str, torch.Tensor]:
    """(ids, token mask, token log-probs) per row -> padded tensors in target space."""
    width = max(len(ids) for ids, _, _ in sequences)
    b = len(sequences)
    ids_t = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    resp = torch.zeros((b, width - 1), dtype=torch.float32)
    behaviour = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, (ids, mask, logps) in enumerate(sequences):
        n = len(ids)
        ids_t[i, :n] = torch.tensor(ids)
        attn[i, :n] = 1
        if n > 1:
            resp[i, : n - 1] = torch.tensor(mask[1:], dtype=torch.float32)
            behaviour[i, : n - 1] = torch.tensor(logps[1:], dtype=torch.float32)
    return {
        "input_ids": ids_t,
        "attention_mask": attn,
        "response_mask": resp,
        "behaviour_log_probs": behaviour,
    }


def _add_routes(tensors: dict[str, torch.Tensor], routes: list[Any], lengths: list[int]) -> None:
    """Router replay: the rows' routed experts as ``routed_experts`` [B, T, L, K] (NO_ROUTE
    where a row has none); nothing when no row has any."""
    dense = routes_tensor(routes, lengths, tensors["input_ids"].shape[1])
    if dense is not None:
        tensors[ROUTES_KEY] = dense


class _Dropped:
    """Rows that are not trained (the last line of defence; none is expected): a row the
    model generated no token of (nothing to learn from, yet it would cost a forward and a
    backward and move its group's statistics), or one longer than ``max_len`` (the context
    the recipe allows: a row the model never saw whole)."""

    def __init__(self, max_len: int | None) -> None:
        self.max_len = max_len
        self.no_generated = 0
        self.too_long = 0

    def keep(self, n_ids: int, n_generated: int) -> bool:
        if n_generated == 0:
            self.no_generated += 1
            return False
        if self.max_len is not None and n_ids > self.max_len:
            self.too_long += 1
            return False
        return True

    def meta(self, kept: int) -> dict[str, int]:
        if not kept:
            raise RollError(
                f"no row of this batch can be trained: {self.no_generated} had no generated "
                f"token and {self.too_long} were longer than the context ({self.max_len} "
                "tokens).",
                hint="An episode whose first prompt plus rollout.max_new_tokens does not fit "
                "rollout.max_context ends before the model generates anything: raise "
                "rollout.max_context, or shorten the env's system prompt / first observation.",
            )
        return {DROPPED_NO_GENERATED: self.no_generated, DROPPED_TOO_LONG: self.too_long}


EPISODE_ROW = "episode_row"
"""``Batch.non_tensors`` key: each row's ``(episode, part)``: the episode's index in the step's
groups flattened, and the row's segment (trajectory mode) or turn (step mode) in it."""

DROPPED_NO_GENERATED = "rows_dropped_no_generated"
DROPPED_TOO_LONG = "rows_dropped_too_long"
"""``Batch.meta`` keys: rows of the batch's episodes that were not trained (_Dropped)."""


def trajectory_batch(
    groups: list[list[Trajectory]], *, pad_id: int, max_len: int | None = None
) -> Batch:
    """One row per episode (StarPO); an agent episode whose calls did not continue one
    conversation (``rollout.agent_history: segment``) has one row per segment, each with the
    episode's return and group (``episode_ids`` says which episode: the group estimators count
    an episode once, however many segments it has). A row with no generated token, or longer
    than ``max_len``, is left out and counted in ``meta`` (``rows_dropped_*``)."""
    trajs = [t for g in groups for t in g]
    dropped = _Dropped(max_len)
    segs = [
        (t, k, trace, e)
        for e, t in enumerate(trajs)
        for k, trace in enumerate(t.traces())
        if dropped.keep(len(trace.ids), sum(trace.mask))
    ]
    meta = dropped.meta(len(segs))
    rows = [(trace.ids, trace.mask, trace.log_probs) for _, _, trace, _ in segs]
    tensors = _rows(rows, pad_id)
    _add_routes(tensors, [trace.routes for _, _, trace, _ in segs], [len(r[0]) for r in rows])
    group_index = {g: k for k, g in enumerate(dict.fromkeys(t.group for t in trajs))}

    def version(t: Trajectory, k: int) -> int:
        return min((u.policy_version for u in t.turns if u.segment == k), default=t.min_version)

    tensors |= {
        "episode_ids": torch.tensor([e for *_, e in segs], dtype=torch.long),
        "scores": torch.tensor([t.episode_return for t, *_ in segs], dtype=torch.float32),
        "group_ids": torch.tensor([group_index[t.group] for t, *_ in segs], dtype=torch.long),
        "response_lengths": torch.tensor([sum(s[2].mask) for s in segs], dtype=torch.long),
        "policy_versions": torch.tensor([version(t, k) for t, k, *_ in segs], dtype=torch.long),
    }
    return Batch(
        tensors=tensors,
        non_tensors={
            "env_tag": [t.tag for t, *_ in segs],
            # each row's episode (its index in the step's groups, flattened) and segment
            EPISODE_ROW: [(e, k) for _, k, _, e in segs],
            **vision_fields([tr.vision() for _, _, tr, _ in segs]),
        },
        meta=meta,
    )


def step_batch(
    groups: list[list[Trajectory]], *, pad_id: int, gamma: float = 1.0, max_len: int | None = None
) -> Batch:
    """One row per turn (GiGPO), with the inputs of the GiGPO advantages; a turn with no
    generated token, or longer than ``max_len``, is left out and counted as in
    :func:`trajectory_batch`."""
    trajs = [t for g in groups for t in g]
    dropped = _Dropped(max_len)
    rows, returns, episode_of, anchors, versions, rewards, tags = [], [], [], [], [], [], []
    visions: list[Any] = []
    routes: list[Any] = []
    parts: list[tuple[int, int]] = []
    group_index = {g: k for k, g in enumerate(dict.fromkeys(t.group for t in trajs))}
    anchor_index: dict[tuple[int, str], int] = {}
    for e, traj in enumerate(trajs):
        step_returns = discounted_step_returns([turn.reward for turn in traj.turns], gamma)
        for k, (turn, ret) in enumerate(zip(traj.turns, step_returns, strict=True)):
            ids = turn.prompt_ids + turn.response_ids
            if not dropped.keep(len(ids), len(turn.response_ids)):
                continue
            mask = [0] * len(turn.prompt_ids) + [1] * len(turn.response_ids)
            logps = [0.0] * len(turn.prompt_ids) + list(turn.log_probs)
            rows.append((ids, mask, logps))
            returns.append(ret)
            episode_of.append(e)
            key = (traj.group, turn.state_key)
            anchors.append(anchor_index.setdefault(key, len(anchor_index)))
            versions.append(turn.policy_version)
            rewards.append(turn.reward)
            tags.append(traj.tag)
            visions.append(turn.vision)
            routes.append(turn.routed_experts)
            parts.append((e, k))
    dropped_meta = dropped.meta(len(rows))
    tensors = _rows(rows, pad_id)
    _add_routes(tensors, routes, [len(r[0]) for r in rows])
    tensors |= {
        "scores": torch.tensor(returns, dtype=torch.float32),
        "step_rewards": torch.tensor(rewards, dtype=torch.float32),
        "step_returns": torch.tensor(returns, dtype=torch.float32),
        "step_episode": torch.tensor(episode_of, dtype=torch.long),
        "anchor_ids": torch.tensor(anchors, dtype=torch.long),
        "group_ids": torch.tensor(
            [group_index[trajs[e].group] for e in episode_of], dtype=torch.long
        ),
        "response_lengths": torch.tensor([sum(m) for _, m, _ in rows], dtype=torch.long),
        "policy_versions": torch.tensor(versions, dtype=torch.long),
    }
    meta = {
        "episode_returns": [t.episode_return for t in trajs],
        "episode_groups": [group_index[t.group] for t in trajs],
        **dropped_meta,
    }
    non_tensors: dict[str, list[Any]] = {"env_tag": tags, EPISODE_ROW: parts}
    non_tensors |= vision_fields(visions)
    return Batch(tensors=tensors, non_tensors=non_tensors, meta=meta)


def episode_metrics(trajs: list[Trajectory], *, prefix: str) -> dict[str, float]:
    """Success, return, length, invalid actions, tokens and time split; overall and per tag."""
    out: dict[str, float] = {}
    by_tag: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_tag[t.tag].append(t)
    parts = [("", trajs)]
    if len(by_tag) > 1:
        parts += [(f"{tag}/", ts) for tag, ts in sorted(by_tag.items())]
    for sub, ts in parts:
        if not ts:
            continue
        n = len(ts)
        turns = [turn for t in ts for turn in t.turns]
        gen = sum(turn.gen_s for turn in turns)
        env = sum(turn.env_s for turn in turns)
        p = f"{prefix}/{sub}"
        out[f"{p}success_rate"] = sum(t.success for t in ts) / n
        out[f"{p}episode_return"] = sum(t.episode_return for t in ts) / n
        out[f"{p}episode_length"] = sum(len(t.turns) for t in ts) / n
        out[f"{p}invalid_action_rate"] = sum(not turn.action_is_valid for turn in turns) / max(
            1, len(turns)
        )
        traces = [tr for t in ts for tr in t.traces()]
        out[f"{p}tokens_per_trajectory"] = sum(len(tr.ids) for tr in traces) / n
        out[f"{p}generated_tokens_per_trajectory"] = sum(sum(tr.mask) for tr in traces) / n
        out[f"{p}segments_per_episode"] = len(traces) / n
        out[f"{p}turn_generate_s"] = gen / max(1, len(turns))
        out[f"{p}turn_env_s"] = env / max(1, len(turns))
        out[f"{p}env_time_share"] = env / max(1e-9, gen + env)
        out[f"{p}context_truncated_rate"] = sum(t.status == "context" for t in ts) / n
        out[f"{p}failed_rate"] = sum(not t.ok for t in ts) / n
        for name in sorted({k for t in ts for k in t.env_metrics}):  # the env's own numbers
            values = [t.env_metrics[name] for t in ts if name in t.env_metrics]
            out[f"{p}env/{name}"] = sum(values) / len(values)
    return out
