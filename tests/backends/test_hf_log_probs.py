"""The hf engine's log-probs of the sampled tokens, computed one decoding step at a time."""

from __future__ import annotations

import math

import torch

from roll_core.backends.infer.hf import _sampled_log_probs


def test_hand_computed_values() -> None:
    # step 0: logits (0, ln 3) -> p = (1/4, 3/4); step 1 at temperature 2: (0, 2 ln 2) / 2 =
    # (0, ln 2) -> p = (1/3, 2/3)
    steps = (
        torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]]),
        torch.tensor([[0.0, 2 * math.log(2.0)], [0.0, 2 * math.log(2.0)]]),
    )
    tokens = torch.tensor([[1, 0], [0, 1]])
    got = _sampled_log_probs(steps, tokens, 2.0)
    # at temperature 2 step 0 is (0, ln 3 / 2): p = (1, sqrt 3) / (1 + sqrt 3)
    s3 = math.sqrt(3.0)
    want = [
        [math.log(s3 / (1 + s3)), math.log(1 / 3)],
        [math.log(1 / (1 + s3)), math.log(2 / 3)],
    ]
    assert got.dtype == torch.float32 and got.shape == (2, 2)
    torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-6)


def test_same_as_one_stacked_pass() -> None:
    g = torch.Generator().manual_seed(0)
    steps = tuple(torch.randn(3, 1000, generator=g).to(torch.bfloat16) for _ in range(5))
    tokens = torch.randint(0, 1000, (3, 5), generator=g)
    stacked = torch.stack(steps, dim=1).float() / 0.7
    want = torch.log_softmax(stacked, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(_sampled_log_probs(steps, tokens, 0.7), want)


def test_no_new_tokens() -> None:
    assert _sampled_log_probs((), torch.zeros((4, 0), dtype=torch.long), 1.0).shape == (4, 0)
