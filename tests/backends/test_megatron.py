"""The `megatron` train backend (megatron-core on CPU over gloo) against roll's 1-process
torch backend on the same model and global batch.

Each layout is one launch of its ranks (a subprocess each, through a real Cluster of
ActorTrain, as a pipeline builds it); within it: two SFT steps and one RL (policy-gradient)
step give the torch backend's losses, gradients (layouts without data parallelism: the
distributed optimizer keeps only a shard of the reduced gradient) and weights within 1e-5;
log-probs match; an offload of optimizer, grads and params after the first step frees every
byte and changes no number; the HF export (`final/`) equals the trained weights; `roll convert
mcore2hf` on the layout's own checkpoint equals `final/` bit for bit (a partial or mixed one is
an error naming the file); a checkpoint resumes bit for bit. The global batch has 8 rows of unequal length (padding inside micro-batches, an
uneven token-balanced split over the ranks).

Costs (2 shared cores, load ~1.5-3): 18-21 s per 2-rank layout, 39 s for the 4-rank one,
27 s for the CLI run; the 8-rank TP2 x PP2 x EP2 x DP2 + SP layout takes 65 s at load 1.5 and
several minutes on a busy machine: it runs only with ROLL_TEST_MEGATRON_8=1. The PP=2 layout
also launches the frozen reference's 2 ranks; the rlvr run into vLLM (megatron, vLLM and a
critic in one launch) took 117 s at load 6-10 (75 s at load 6 without the critic).
At load 10-18 (2026-11-27, with the offload and convert checks): EP=2 121 s, TP=2 67 s, PP=2
112 s, the 4-rank layout 118 s, the 8-rank one 205 s; `roll sft` on the MoE with EP=2 plus
`roll convert` twice 111 s; the MoE rlvr run with offload 222 s.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from roll_core.backends.train import TorchTrainBackend  # noqa: E402
from roll_core.backends.train.base import TrainBackendSpec  # noqa: E402
from roll_core.config.algorithm import AlgorithmConfig  # noqa: E402
from roll_core.config.schema import MegatronConfig, OptimConfig  # noqa: E402
from roll_core.data import Batch  # noqa: E402
from roll_core.engine import Cluster, LocalExecutor  # noqa: E402
from roll_core.models import resolve_model_path  # noqa: E402
from roll_core.workers.actor_train import ActorTrain  # noqa: E402
from roll_core.workers.objectives import get_objective  # noqa: E402
from roll_core.workers.reference import Reference  # noqa: E402

ROWS, WIDTH, PROMPT = 8, 12, 4
TOL = 1e-5
ALGO = {"preset": "grpo", "kl": {"coef": 0.0}}


class GradActorTrain(ActorTrain):
    """ActorTrain plus the last step's gradients (HF names, gathered on rank 0)."""

    def full_grads(self) -> dict[str, torch.Tensor]:
        return self._b().full_grads()  # type: ignore[attr-defined]


# ---- models and batches ----------------------------------------------------------------------


def tiny_qwen3() -> str:
    """builtin tiny-qwen3: Qwen3 dense, 2 layers, tied embeddings."""
    return resolve_model_path("builtin:tiny-qwen3")


def tiny_qwen3_moe(directory: Path) -> str:
    """Qwen3-MoE, 4 layers x 4 experts (top 2), untied, the builtin tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if not (directory / "model.safetensors").is_file():
        cfg = Qwen3MoeConfig(
            vocab_size=320, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            tie_word_embeddings=False, max_position_embeddings=128,
        )  # fmt: skip
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
        for f in [*Path(tiny_qwen3()).glob("*token*"), Path(tiny_qwen3()) / "chat_template.jinja"]:
            shutil.copy(f, directory)
    return str(directory)


def rows_and_masks() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (ROWS, WIDTH), generator=g)
    attn = torch.ones_like(ids)
    for row, end in ((1, 7), (3, 5), (4, 9), (6, 6)):  # right padding
        attn[row, end:] = 0
    return ids, attn


def sft_batch() -> Batch:
    ids, attn = rows_and_masks()
    loss_mask = attn.clone()
    loss_mask[:, :PROMPT] = 0
    return Batch(
        tensors={"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask},
        meta={"loss_tokens": int(loss_mask[:, 1:].sum())},
    )


def rl_batch() -> Batch:
    ids, attn = rows_and_masks()
    g = torch.Generator().manual_seed(1)
    response = attn[:, 1:].clone().float()
    response[:, : PROMPT - 1] = 0
    advantages = torch.randn(ROWS, 1, generator=g).expand(ROWS, WIDTH - 1).clone() * response
    behaviour = -torch.rand(ROWS, WIDTH - 1, generator=g) * 3 * response
    return Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": attn,
            "response_mask": response,
            "advantages": advantages,
            "behaviour_log_probs": behaviour,
        },
        meta={
            "response_tokens": int(response.sum()),
            "sequences": ROWS,
            "max_response_length": WIDTH - PROMPT,
        },
    )


ROOT = Path(__file__).resolve().parents[2]
GREEDY_PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15]]


def backend_kwargs(model: str) -> dict[str, Any]:
    return dict(
        model_path=model,
        tokenizer_path=tiny_qwen3(),
        optim=OptimConfig(lr=1e-3, eps=1e-6, warmup_steps=1, scheduler="linear"),
        total_steps=10,
        micro_batch_size=2,
        seed=0,
        num_threads=1,
        device="cpu",
        precision="fp32",
    )


def hf_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 module names -> checkpoint names: its MoE experts are fused
    (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), the checkpoint and
    the megatron backend name every expert's tensors (`experts.{e}.gate_proj.weight`, ...)."""
    out = {}
    for name, t in weights.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            gates, ups = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gates[e]
                out[f"{base}{e}.up_proj.weight"] = ups[e]
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e, down in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = down
        else:
            out[name] = t
    return out


# ---- the reference: roll's torch backend, one process ----------------------------------------


def reference(model: str) -> dict[str, Any]:
    """2 SFT steps and 1 RL step of the torch backend: per-step metrics, the gradients of the
    first step (before clipping) and of the RL step, the final weights and log-probs."""
    threads = torch.get_num_threads()
    backend = TorchTrainBackend(TrainBackendSpec(**backend_kwargs(model)))
    torch.set_num_threads(threads)
    grads: list[dict[str, torch.Tensor]] = []
    clip = torch.nn.utils.clip_grad_norm_

    def keep_grads(params: Any, max_norm: float) -> torch.Tensor:
        grads.append(hf_names({n: p.grad.clone() for n, p in backend.model.named_parameters()}))
        return clip(params, max_norm)

    torch.nn.utils.clip_grad_norm_ = keep_grads  # type: ignore[assignment]
    initial_log_probs = backend.log_probs(sft_batch())
    try:
        algo = AlgorithmConfig.model_validate(ALGO)
        out = [backend.train_step(sft_batch(), get_objective("sft")) for _ in range(2)]
        out.append(backend.train_step(rl_batch(), get_objective("rl", algorithm=algo)))
    finally:
        torch.nn.utils.clip_grad_norm_ = clip  # type: ignore[assignment]
    weights = hf_names({n: p.detach().clone() for n, p in backend.model.named_parameters()})
    return {"metrics": out, "grads": grads, "weights": weights,
            "log_probs": backend.log_probs(sft_batch()),
            "entropy": backend.token_stats(sft_batch())["entropy"],
            "greedy": backend.generate(GREEDY_PROMPTS, max_new_tokens=3),
            "initial_log_probs": initial_log_probs}  # fmt: skip


# ---- one launch of a layout -----------------------------------------------------------------


def sum_over_ranks(per_rank: list[dict[str, float]], key: str) -> float:
    return sum(m.get(key, 0.0) for m in per_rank)


def close(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=name)


def check_frozen_reference(model: str, layout: dict[str, Any], world: int, ex: Any,
                           want: torch.Tensor) -> None:  # fmt: skip
    """The KL reference of a megatron run (roles.build_reference): the frozen megatron model
    on the same layout gives the starting model's log-probs."""
    spec = TrainBackendSpec(backend="megatron", frozen=True, **backend_kwargs(model),
                            megatron=MegatronConfig(**layout))  # fmt: skip
    ref = Cluster("reference", Reference, ex, world_size=world,
                  worker_kwargs={"model_path": model, "spec": spec})  # fmt: skip
    ref.run("setup")
    close(torch.cat(ref.run_dp("log_probs", sft_batch())), want, "reference log_probs")


def check_offload_round_trip(actor: Any) -> None:
    """`actor_train.offload` on megatron: every part's storage is freed (0 bytes held) and
    comes back; the steps after it still match the torch backend (the caller checks), so the
    round trip changed no number."""
    parts = ["optimizer", "grads", "params"]
    for report in actor.run("offload", parts):
        for part in parts:
            assert report[f"bytes/{part}"] > 0, (part, report)
            assert report[f"held/{part}"] == 0, (part, report)
    for report in actor.run("reload"):
        assert all(report[f"bytes/{part}"] > 0 for part in parts), report


def check_convert(ckpt: Path, final: Path, tmp: Path) -> None:
    """`roll convert mcore2hf` on the run's own per-rank checkpoint gives `final/` bit for bit
    (the checkpoint was saved right after the export); a missing rank file or a file of
    another layout is an error naming the file."""
    from roll_core.convert import mcore_to_hf
    from roll_core.errors import CheckpointError

    result = mcore_to_hf(ckpt, tmp / "converted", tokenizer=final)
    assert result.layout == "roll megatron"
    converted = load_file(str(tmp / "converted" / "model.safetensors"))
    exported = load_file(str(final / "model.safetensors"))
    assert converted.keys() == exported.keys()
    for name, t in exported.items():
        assert torch.equal(converted[name], t), name
    ranks = sorted(ckpt.glob("megatron-rank*.pt"))
    partial = tmp / "partial"
    partial.mkdir()
    for f in ranks[:-1]:
        os.link(f, partial / f.name)
    with pytest.raises(CheckpointError, match=ranks[-1].name):
        mcore_to_hf(partial, tmp / "bad")
    state = torch.load(ranks[-1], weights_only=False)
    state["layout"] = {**state["layout"], "tp": state["layout"]["tp"] + 1}
    torch.save(state, partial / ranks[-1].name)
    with pytest.raises(CheckpointError, match=f"{ranks[-1].name} was saved with layout"):
        mcore_to_hf(partial, tmp / "bad")
    assert not (tmp / "bad").exists()


def check_layout(
    model: str,
    layout: dict[str, Any],
    world: int,
    tmp: Path,
    *,
    frozen_reference: bool = False,
    chunk_tokens: int | None = None,
) -> None:
    """``chunk_tokens``: actor_train.logit_chunk_tokens (None: one chunk of this vocabulary)."""
    ref = reference(model)
    ex = LocalExecutor()
    try:
        if frozen_reference:
            check_frozen_reference(model, layout, world, ex, ref["initial_log_probs"])
        actor = Cluster(
            "actor_train", GradActorTrain, ex, world_size=world,
            worker_kwargs={"spec": TrainBackendSpec(
                backend="megatron", **backend_kwargs(model), megatron=MegatronConfig(**layout),
                logit_chunk_tokens=chunk_tokens)},
        )  # fmt: skip
        actor.run("setup")
        assert actor.dist_backend == "gloo"
        dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
        algo = AlgorithmConfig.model_validate(ALGO)

        # -- SFT x 2, then RL x 1: losses, grad norms and the first step's gradients
        for step in range(3):
            if step < 2:
                out = actor.run_dp("train_step", sft_batch(), objective="sft")
                loss = sum_over_ranks(out, "train/loss_sum")
                assert loss == pytest.approx(ref["metrics"][step]["train/loss_sum"], rel=TOL)
            else:
                out = actor.run_dp("train_step", rl_batch(), objective="rl", algorithm=algo)
                for key in ("actor/pg_loss", "actor/entropy"):
                    expected = ref["metrics"][step][key]
                    assert sum_over_ranks(out, key) == pytest.approx(expected, rel=TOL), key
            assert out[0]["train/grad_norm"] == pytest.approx(
                ref["metrics"][step]["train/grad_norm"], rel=TOL
            )
            assert out[0]["train/lr"] == ref["metrics"][step]["train/lr"]
            if step == 0:
                check_offload_round_trip(actor)
            if dp == 1 and step in (0, 2):
                # megatron clips its gradient buffer in place; the reference's are unclipped
                got = actor.run("full_grads")[0]
                want = ref["grads"][step]
                norm = ref["metrics"][step]["train/grad_norm"]
                scale = min(1.0, 1.0 / (norm + 1e-6))  # the clip factor (max_grad_norm 1.0)
                assert got.keys() == want.keys()
                for name, g in got.items():
                    close(g, want[name] * scale, f"grad {name} step {step}")

        # -- weights, log-probs and the export
        weights = actor.run_rank0("named_weights")
        assert weights.keys() == ref["weights"].keys()
        for name, w in weights.items():
            close(w, ref["weights"][name], name)
        log_probs = torch.cat(actor.run_dp("log_probs", sft_batch()))
        close(log_probs, ref["log_probs"], "log_probs")
        stats = actor.run_dp("token_stats", sft_batch())
        close(torch.cat([s["log_probs"] for s in stats]), ref["log_probs"], "token_stats")
        close(torch.cat([s["entropy"] for s in stats]), ref["entropy"], "entropy")
        greedy = actor.run_rank0("generate", GREEDY_PROMPTS, max_new_tokens=3)
        assert greedy == ref["greedy"]
        actor.run_rank0("export", str(tmp / "final"))
        exported = load_file(str(tmp / "final" / "model.safetensors"))
        assert exported.keys() == weights.keys()
        for name, w in weights.items():
            assert torch.equal(exported[name], w), name
        assert (tmp / "final" / "config.json").is_file()
        assert (tmp / "final" / "tokenizer_config.json").is_file()

        # -- resume: step 4 changes weights, Adam moments, the LR step and RNG; loading the
        # checkpoint and repeating it gives the same bits
        actor.run("save", str(tmp / "ckpt"))
        check_convert(tmp / "ckpt", tmp / "final", tmp)
        actor.run_dp("train_step", sft_batch(), objective="sft")
        expected = actor.run_rank0("state_digest")
        actor.run("load", str(tmp / "ckpt"))
        actor.run_dp("train_step", sft_batch(), objective="sft")
        assert actor.run_rank0("state_digest") == expected
    finally:
        ex.shutdown()


# ---- MoE routing replay ----------------------------------------------------------------------


def routed_sft_batch(layers: int, experts: int, k: int) -> Batch:
    """sft_batch() with recorded routes: k distinct random experts per token and layer (most of
    them not the model's own choice), NO_ROUTE on padding and on each row's last token."""
    from roll_core.models.routing import NO_ROUTE, ROUTES_KEY

    batch = sft_batch()
    attn = batch.tensors["attention_mask"]
    g = torch.Generator().manual_seed(2)
    routes = torch.rand(ROWS, WIDTH, layers, experts, generator=g).argsort(-1)[..., :k]
    last = attn.sum(1) - 1
    routes[attn == 0] = NO_ROUTE
    routes[torch.arange(ROWS), last] = NO_ROUTE
    batch.tensors[ROUTES_KEY] = routes.to(torch.int8)
    return batch


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"ep": 2}, id="ep2"),
        # extended: the TP+SP replay (the EP one runs by default)
        pytest.param({"tp": 2, "sp": True}, id="tp2-sp", marks=pytest.mark.extended),
    ],
)
def test_router_replay_equals_torch(layout: dict[str, Any], tmp_path: Path) -> None:
    """`algorithm.router_replay: r3` on megatron (EP=2; TP=2 with sequence parallelism, where
    each rank routes half of the sequence) and on the torch backend, routes that differ from
    the model's own: the log-probs, one SFT step's loss and gradient norm and the routing
    agreement agree within 1e-5; without replay the log-probs differ (the routes change the
    forward)."""
    model = tiny_qwen3_moe(tmp_path / "moe")
    batch = routed_sft_batch(layers=4, experts=4, k=2)
    torch_r3 = TorchTrainBackend(TrainBackendSpec(**backend_kwargs(model), router_replay="r3"))
    assert torch_r3.router_replay is not None
    want_lp = torch_r3.log_probs(batch)
    torch_r3.router_replay.reset_metrics()
    want = torch_r3.train_step(batch, get_objective("sft"))
    want_agreement = torch_r3.router_replay.metrics()["router/agreement"]
    assert want_agreement < 0.8  # most recorded choices are not the model's own
    plain = TorchTrainBackend(TrainBackendSpec(**backend_kwargs(model))).log_probs(batch)
    assert float((plain - want_lp).abs().max()) > 1e-3

    ex = LocalExecutor()
    try:
        spec = TrainBackendSpec(backend="megatron", router_replay="r3", **backend_kwargs(model),
                                megatron=MegatronConfig(**layout))  # fmt: skip
        actor = Cluster("actor_train", ActorTrain, ex, world_size=2,
                        worker_kwargs={"spec": spec})  # fmt: skip
        actor.run("setup")
        close(torch.cat(actor.run_dp("log_probs", batch)), want_lp, "replayed log_probs")
        out = actor.run_dp("train_step", batch, objective="sft")
        loss = sum_over_ranks(out, "train/loss_sum")
        assert loss == pytest.approx(want["train/loss_sum"], rel=TOL)
        assert out[0]["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=TOL)
        agreement = sum_over_ranks(out, "router/agreement")
        assert agreement == pytest.approx(want_agreement, rel=TOL)
    finally:
        ex.shutdown()


# ---- the layouts -----------------------------------------------------------------------------


@pytest.mark.slow
def test_tensor_parallel_dense(tmp_path: Path) -> None:
    """TP=2 with sequence parallelism, Qwen3 dense (tied embeddings), the output layer 3
    positions at a time (8 chunks per micro-batch, recomputed in the backward: each TP rank
    its vocabulary shard, gathered per chunk)."""
    check_layout(tiny_qwen3(), {"tp": 2, "sp": True}, 2, tmp_path, chunk_tokens=3)


@pytest.mark.slow
def test_pipeline_parallel_dense(tmp_path: Path) -> None:
    """PP=2 (1F1B), Qwen3 dense: the tied embedding lives on both stages. Also the frozen
    reference on that layout (forward-only pipeline of unwrapped chunks)."""
    check_layout(tiny_qwen3(), {"pp": 2}, 2, tmp_path, frozen_reference=True)


@pytest.mark.slow
def test_expert_parallel_moe(tmp_path: Path) -> None:
    """EP=2 (alltoall dispatcher; data parallel 2 for the dense part), Qwen3-MoE (untied
    output layer), 5 positions of it at a time."""
    check_layout(tiny_qwen3_moe(tmp_path / "moe"), {"ep": 2}, 2, tmp_path, chunk_tokens=5)


@pytest.mark.slow
@pytest.mark.extended  # TP+SP, PP and EP each run alone in the default suite
def test_combined_layout_moe(tmp_path: Path) -> None:
    """PP=2 with 2 virtual stages each (interleaved 1F1B) x TP=2 + SP, Qwen3-MoE, 4 ranks."""
    check_layout(
        tiny_qwen3_moe(tmp_path / "moe"), {"tp": 2, "pp": 2, "vpp": 2, "sp": True}, 4, tmp_path
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("ROLL_TEST_MEGATRON_8"),
    reason="8 ranks: 1 min idle, minutes loaded (opt in)",
)
def test_tp_pp_ep_dp_on_eight_ranks(tmp_path: Path) -> None:
    """TP2 x PP2 x EP2 x DP2 + SP on 8 ranks, Qwen3-MoE."""
    check_layout(
        tiny_qwen3_moe(tmp_path / "moe"), {"tp": 2, "pp": 2, "ep": 2, "sp": True}, 8, tmp_path
    )


# ---- the CLI ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_roll_sft_with_the_megatron_backend(roll, tiny_recipe, tmp_path: Path) -> None:
    """`roll sft` on tiny-qwen3 with actor_train.backend megatron (TP=2 + SP, 2 ranks): it
    trains, checkpoints with the recipe's layout, and `final/` is a Hugging Face model
    transformers loads."""
    import json

    from transformers import AutoModelForCausalLM

    recipe = tiny_recipe(
        trainer={"max_steps": 4, "micro_batch_size": 4, "grad_accum_steps": 1},
        actor_train={
            "backend": "megatron",
            "world_size": 2,
            "megatron": {"tp": 2, "sp": True},
            "num_threads": 1,
            "optim": {"lr": 3.0e-3, "warmup_steps": 1},
        },
        eval={"every_steps": 4, "exact_match": False},
        checkpoint={"every_steps": 2, "keep_last": 1},
    )
    r = roll("sft", str(recipe), "--run-id", "megatron-00", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "megatron-00"
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    losses = [s["train/loss"] for s in steps if "train/loss" in s]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step-000004"]
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert model.config.model_type == "qwen3"
    (rank0,) = (run / "checkpoints").rglob("megatron-rank00000.pt")
    layout = torch.load(rank0, weights_only=False)["layout"]
    assert (layout["tp"], layout["sp"]) == (2, True), layout  # the recipe's section was used


@pytest.mark.slow
@pytest.mark.extended  # megatron SFT and mcore2hf conversion run end to end by default tests
def test_roll_sft_moe_expert_parallel_then_convert(roll, tiny_recipe, tmp_path: Path) -> None:
    """`roll sft` on the tiny Qwen3-MoE with actor_train.backend megatron, EP=2 (2 ranks): it
    trains (the loss falls), checkpoints with the recipe's layout, `final/` loads in
    transformers; `roll convert mcore2hf` on the run's checkpoints (through `latest`) writes
    the same tensors bit for bit (the last checkpoint is the final step), so transformers gives
    the same logits from both; a checkpoint missing a rank's file is refused, naming it."""
    import json

    from transformers import AutoModelForCausalLM

    model = tiny_qwen3_moe(tmp_path / "moe")
    recipe = tiny_recipe(
        model={"path": model},
        trainer={"max_steps": 4, "micro_batch_size": 4, "grad_accum_steps": 1},
        actor_train={
            "backend": "megatron",
            "world_size": 2,
            "megatron": {"ep": 2},
            "num_threads": 1,
            "optim": {"lr": 3.0e-3, "warmup_steps": 1},
        },
        eval={"every_steps": 4, "exact_match": False},
        checkpoint={"every_steps": 2, "keep_last": 1},
    )
    r = roll("sft", str(recipe), "--run-id", "mgt-moe-sft", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "mgt-moe-sft"
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    losses = [s["train/loss"] for s in steps if "train/loss" in s]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    ckpt = run / "checkpoints" / "step-000004" / "actor_train"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "megatron-rank00000.pt", "megatron-rank00001.pt"
    ]  # fmt: skip
    assert torch.load(ckpt / "megatron-rank00000.pt", weights_only=False)["layout"]["ep"] == 2

    out = tmp_path / "converted"
    r = roll("convert", "mcore2hf", str(run / "checkpoints"), str(out), "--tokenizer",
             str(run / "final"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "roll megatron checkpoint" in r.stdout, r.stdout
    final = load_file(str(run / "final" / "model.safetensors"))
    converted = load_file(str(out / "model.safetensors"))
    assert final.keys() == converted.keys() and any(".experts.3." in n for n in final)
    assert all(torch.equal(converted[n], t) for n, t in final.items())
    ids = torch.tensor([[5, 17, 33, 2, 90, 41]])
    logits = []
    for path in (run / "final", out, Path(model)):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert hf.config.model_type == "qwen3_moe"
        with torch.no_grad():
            logits.append(hf(ids).logits)
    assert torch.equal(logits[0], logits[1])
    assert not torch.allclose(logits[0], logits[2])  # trained: not the starting model

    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(ckpt / "megatron-rank00000.pt", partial)
    r = roll("convert", "mcore2hf", str(partial), str(tmp_path / "bad"))
    assert r.returncode != 0
    assert "megatron-rank00001.pt" in r.stderr and "partial" in r.stderr, r.stderr


@pytest.mark.slow
def test_roll_train_rlvr_with_megatron_expert_parallel(roll, tmp_path: Path) -> None:
    """`roll train rlvr` on a tiny Qwen3-MoE with actor_train.backend megatron, EP=2 (2
    ranks), hf inference: the weight sync streams per-expert checkpoint names into the hf
    model's fused expert tensors, so the behaviour log-probs equal the trainer's; the KL
    reference runs on the same EP=2 layout. actor_train offloads its optimizer, grads and
    params between the colocated turns (CPU: both roles share the host): the bytes move every
    turn and the reloaded weights still give the trainer's log-probs. MoE routing replay is on
    (`algorithm.router_replay: r3`): the hf engine's recorded routes reach both megatron roles
    (the update and the EP=2 reference) through the CLI's batches; at fp32 they are the
    trainer's own choices (agreement 1), so nothing above moves."""
    import json

    model = tiny_qwen3_moe(tmp_path / "moe")
    r = roll(
        "train", "rlvr", str(ROOT / "recipes" / "tiny-arith-rlvr.yaml"),
        f"model.path={model}", "data.chat_template=none", f"runs_dir={tmp_path / 'runs'}",
        "trainer.max_steps=2", "rollout.prompts_per_step=4", "rollout.n=4",
        "eval.every_steps=null", "eval.max_samples=8", "actor_train.backend=megatron",
        "actor_train.world_size=2", "actor_train.megatron.ep=2", "actor_train.packing=false",
        "actor_train.num_threads=1", "trainer.micro_batch_size=8",
        "actor_train.offload.optimizer=true", "actor_train.offload.grads=true",
        "actor_train.offload.params=true", "algorithm.router_replay=r3", "--run-id", "mgt-moe",
        timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "runs" / "mgt-moe" / "metrics.jsonl").open()]
    diffs = [
        s["train_infer/logprob_diff_max"] for s in steps if "train_infer/logprob_diff_max" in s
    ]
    assert len(diffs) == 2 and max(diffs) < 1e-5, diffs
    # grpo's KL: the reference is the frozen megatron twin with EP=2, the starting policy
    assert steps[0]["actor/kl_loss"] < 1e-7, steps[0]
    assert all(s["offload/actor_train_bytes"] > 0 for s in steps), steps
    assert all(s["reload/actor_train_bytes"] > 0 for s in steps), steps
    agreement = [s["router/agreement"] for s in steps if "router/agreement" in s]
    assert agreement == [1.0, 1.0], steps  # reported once per step (rank 0), every layer
    assert all(s["router/agreement_layer03"] == 1.0 for s in steps if "router/agreement" in s)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.extended  # megatron RL runs end to end in the default suite (EP=2)
def test_roll_train_rlvr_dense_tensor_parallel_into_vllm(roll, tmp_path: Path) -> None:
    """`roll train rlvr` on tiny-qwen3 (dense) with actor_train.backend megatron, TP=2 + SP (2
    ranks), and actor_infer.backend vllm (CPU build): the weight sync gathers each tensor over
    the TP ranks, renames it to the HF checkpoint name and streams it in buckets into vLLM,
    whose loader fuses q/k/v and gate/up itself. Step 2 samples with the weights synced after
    step 1's update (lr 1e-2: a stale engine would be off by ~1e-1), so its log-probs equal
    the trainer's only if the sync is right. The same launch runs the critic (gae, one torch
    rank) beside megatron."""
    import json

    recipe = {
        "pipeline": "rlvr",
        "name": "tiny-rl-megatron-vllm",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 16},
            "max_prompt_length": 64,
        },
        "rollout": {"n": 4, "prompts_per_step": 4, "max_new_tokens": 6},
        # no KL: the reference's 2 megatron ranks are checked in the MoE run and on PP=2
        "algorithm": {"preset": "ppo", "kl": {"coef": 0.0}},
        # random responses meet this about half the time: the groups have variance
        "reward": {
            "domains": {"math": {"rewards": [{"name": "format", "pattern": ".*[A-Za-z].*"}]}}
        },
        "trainer": {"max_steps": 2, "micro_batch_size": 8},
        "actor_train": {
            "backend": "megatron",
            "world_size": 2,
            "megatron": {"tp": 2, "sp": True},
            "num_threads": 1,
            "optim": {"lr": 1.0e-2},
        },  # fmt: skip
        "critic": {"num_threads": 1},
        "actor_infer": {"backend": "vllm", "num_threads": 1},
        "sync": {"bucket_mb": 1},  # the 1.7 MB model: two buckets
        "eval": {"every_steps": None},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    r = roll("train", "rlvr", str(path), "--run-id", "mgt-vllm", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "runs" / "mgt-vllm" / "metrics.jsonl").open()]
    assert [s["step"] for s in steps] == [1, 2]
    first, second = steps
    assert first["train/lr"] == 1.0e-2 and first["train/grad_norm"] > 0  # the weights moved
    assert second["sync/buckets"] == 2 and second["sync/tensors"] == 24
    # fp32 on both sides; vLLM's CPU kernels differ from megatron's by ~1e-6
    assert second["train_infer/logprob_diff_max"] < 1e-4, second
    assert all(s["critic/grad_norm"] > 0 and "critic/value_loss" in s for s in steps)
