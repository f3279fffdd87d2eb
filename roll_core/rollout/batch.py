"""Scored samples -> the training Batch (token-in/token-out: exactly the generated ids).

Layout: `input_ids` [B, T] = prompt ids + response ids, right-padded. Per-token fields live in
"target" space [B, T-1] (position t scores token t+1), the space of `token_log_probs`:
`response_mask`, `behaviour_log_probs`. Per-sample fields: `scores` [B] (the rewards),
`group_ids` [B], `response_lengths` [B], `policy_versions` [B]. Vision-language samples add the
non-tensor fields `pixel_values` / `image_grid_thw` (one tensor or None per row, see
roll_core/data/vision.py). Router replay adds `routed_experts` [B, T, L, K] (the experts each
input token was routed to when sampled: roll_core/models/routing.py).
"""

from __future__ import annotations

import torch

from roll_core.data import Batch
from roll_core.data.vision import vision_fields
from roll_core.models.routing import ROUTES_KEY, routes_tensor
from roll_core.rollout.one_turn import Sample


def build_rl_batch(groups: list[list[Sample]], *, pad_id: int) -> Batch:
    samples = [s for g in groups for s in g]
    width = max(len(s.prompt.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    resp = torch.zeros((b, width - 1), dtype=torch.float32)
    behaviour = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt.prompt_ids), len(s.response_ids)
        ids[i, : p + r] = torch.tensor(s.prompt.prompt_ids + s.response_ids)
        attn[i, : p + r] = 1
        if r:
            resp[i, p - 1 : p - 1 + r] = (
                1.0  # target position p-1 predicts the first response token
            )
            behaviour[i, p - 1 : p - 1 + r] = torch.tensor(s.log_probs, dtype=torch.float32)
    group_index = {g: k for k, g in enumerate(dict.fromkeys(s.group for s in samples))}
    # router replay: each row's routed experts, [B, T, L, K] (absent when none was recorded)
    routes = routes_tensor(
        [s.routed_experts for s in samples],
        [len(s.prompt.prompt_ids) + len(s.response_ids) for s in samples],
        width,
    )
    batch = Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": attn,
            "response_mask": resp,
            "behaviour_log_probs": behaviour,
            "scores": torch.tensor([s.reward for s in samples], dtype=torch.float32),
            "group_ids": torch.tensor([group_index[s.group] for s in samples], dtype=torch.long),
            "response_lengths": torch.tensor(
                [len(s.response_ids) for s in samples], dtype=torch.long
            ),
            "policy_versions": torch.tensor([s.policy_version for s in samples], dtype=torch.long),
        },
        non_tensors={
            "domain": [str(s.reward_info.get("domain", "")) for s in samples],
            "finish_reason": [s.finish_reason for s in samples],
            "prompt_index": [s.prompt.index for s in samples],  # the row in the prompt list
            # VLM samples: each row's pixel_values / image_grid_thw, exactly what generated it
            **vision_fields([s.prompt.vision for s in samples]),
        },
        meta={},
    )
    if routes is not None:
        batch[ROUTES_KEY] = routes
    return batch
