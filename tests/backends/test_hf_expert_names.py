"""The hf receiver of a weight sync takes checkpoint expert names into transformers 5's fused
mixture-of-experts tensors (what the megatron backend sends)."""

from __future__ import annotations

import torch

from roll_core.backends.infer.hf import fused_expert_view


def test_checkpoint_expert_names_map_to_slices_of_the_fused_tensors() -> None:
    # 2 experts, I = 2, H = 3: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
    gate_up = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    down = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)
    base = "model.layers.0.mlp.experts"
    targets = {f"{base}.gate_up_proj": gate_up, f"{base}.down_proj": down}

    gate = fused_expert_view(targets, f"{base}.1.gate_proj.weight")
    up = fused_expert_view(targets, f"{base}.1.up_proj.weight")
    d0 = fused_expert_view(targets, f"{base}.0.down_proj.weight")
    assert gate is not None and up is not None and d0 is not None
    assert gate.tolist() == [[12.0, 13.0, 14.0], [15.0, 16.0, 17.0]]
    assert up.tolist() == [[18.0, 19.0, 20.0], [21.0, 22.0, 23.0]]
    assert d0.tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]

    up.copy_(torch.full((2, 3), -1.0))  # a view: the sync writes into the fused tensor
    assert gate_up[1, 2:].eq(-1).all() and gate_up[1, :2].ge(0).all() and gate_up[0].ge(0).all()

    assert fused_expert_view(targets, "model.layers.0.mlp.gate.weight") is None
    assert fused_expert_view({}, f"{base}.0.gate_proj.weight") is None
