"""MoE routing replay (R3, roll_core/models/routing.py): the hf engine records the routed
experts of every token, the Batch carries them (packing too), the trainer's forward routes
through them with gate weights from its own router logits; `off` leaves everything as it was;
validation refuses what cannot replay."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from roll_core.backends.infer import Request, SamplingParams
from roll_core.backends.infer.hf import HFInferBackend
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.config.loader import load_recipe
from roll_core.data import Batch
from roll_core.errors import ConfigError
from roll_core.models import materialize_builtin
from roll_core.models.routing import (
    NO_ROUTE,
    ROUTES_KEY,
    RouterReplay,
    extend_routes,
    routes_tensor,
)
from roll_core.pipelines.roles import check_engine_support
from roll_core.rollout.batch import build_rl_batch
from roll_core.rollout.one_turn import Prompt, Sample
from roll_core.workers.objectives import sft

ROOT = Path(__file__).resolve().parents[2]


def make_moe(directory: Path, *, seed: int = 0, std: float = 0.02) -> Path:
    """A random-init tiny Qwen3-MoE (4 experts, top-2, 2 layers) with the built-in tiny
    tokenizer's vocabulary (320 ids). `std`: the init's spread (larger: sharper routers)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        initializer_range=std,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer = Path(materialize_builtin("tiny-qwen3", directory.parent / "cache"))
    for f in tokenizer.glob("*"):
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, directory / f.name)
    return directory


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_moe(tmp_path_factory.mktemp("moe") / "model", std=0.3))


def trainer(path: str, mode: str, *, packing: bool = True) -> TorchTrainBackend:
    return TorchTrainBackend(
        TrainBackendSpec(
            model_path=path,
            device="cpu",
            router_replay=mode,
            packing=packing,
            micro_batch_size=2,
            seed=0,
            num_threads=1,
        )
    )


def sampled(path: str, n: int = 3) -> tuple[list[list[int]], list]:
    """n prompts (two identical: the fixed batch shares their prompt cache) and their
    completions from the fixed-batch path, with routes recorded."""
    engine = HFInferBackend(model_path=path, device="cpu", record_routes=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [5, 6, 7, 8, 9]][:n]
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    done = engine.generate([Request(i, p, seed=i) for i, p in enumerate(prompts)], params)
    return prompts, done


def rl_batch(prompts: list[list[int]], done: list) -> Batch:
    samples = [
        Sample(i, i, Prompt(i, p, {}), c.response_ids, c.log_probs, c.finish_reason, 0,
               routed_experts=c.routed_experts)
        for i, (p, c) in enumerate(zip(prompts, done, strict=True))
    ]  # fmt: skip
    return build_rl_batch([samples], pad_id=0)


def test_the_engines_record_every_fed_token(moe: str) -> None:
    """Fixed batch (with a shared prompt cache) and the request engine: one [L, K] route per
    token fed (prompt + all but the last response token), the same experts the trainer picks
    on the whole sequence at fp32 (agreement 1)."""
    prompts, fixed = sampled(moe)
    engine = HFInferBackend(model_path=moe, device="cpu", record_routes=True)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    streamed = [engine.generate_request(Request(9, prompts[1], seed=1), params)]
    for p, c in [*zip(prompts, fixed, strict=True), (prompts[1], streamed[0])]:
        assert c.routed_experts.dtype == torch.int8
        assert c.routed_experts.shape == (len(p) + len(c.response_ids) - 1, 2, 2)
        assert int(c.routed_experts.min()) >= 0 and int(c.routed_experts.max()) < 4
    tr = trainer(moe, "r3")
    assert tr.router_replay is not None
    tr.router_replay.reset_metrics()
    tr.log_probs(rl_batch([*prompts, prompts[1]], [*fixed, streamed[0]]))
    assert tr.router_replay.metrics()["router/agreement"] == 1.0


def test_replay_off_and_replaying_the_own_routes_are_bit_identical(moe: str) -> None:
    """`off` ignores a batch's routes (the step is today's); `r3` with routes that are the
    trainer's own choices recomputes the very same gate weights: the same bits."""
    prompts, done = sampled(moe)
    with_routes = rl_batch(prompts, done)
    plain = Batch(
        tensors={k: v for k, v in with_routes.tensors.items() if k != ROUTES_KEY},
        non_tensors=with_routes.non_tensors,
        meta=with_routes.meta,
    )
    for b in (with_routes, plain):
        b.tensors["loss_mask"] = b.tensors["attention_mask"].clone()
        b.meta["loss_tokens"] = int(b.tensors["loss_mask"][:, 1:].sum())
    digests = []
    for mode, batch in [("off", plain), ("off", with_routes), ("r3", with_routes)]:
        tr = trainer(moe, mode)
        lp = tr.log_probs(batch)
        metrics = tr.train_step(batch, sft)
        digests.append((lp, metrics["train/grad_norm"], tr.state_digest()))
    for lp, norm, digest in digests[1:]:
        assert torch.equal(lp, digests[0][0])
        assert norm == digests[0][1] and digest == digests[0][2]


def test_replayed_routes_change_the_forward_where_they_differ(moe: str) -> None:
    """Other routes than the trainer's own: the logits change (replay is not a no-op), packed
    and padded give the same log-probs, and the agreement counts the differing choices."""
    prompts, done = sampled(moe)
    batch = rl_batch(prompts, done)
    own = trainer(moe, "r3").log_probs(batch)
    routes = batch.tensors[ROUTES_KEY]
    forced = routes.clone()
    recorded = forced != NO_ROUTE
    forced[recorded] = (forced[recorded].long() + 1).remainder(4).to(forced.dtype)  # all differ
    # keep each token's two choices distinct: (a+1, b+1) mod 4 stays distinct
    batch.tensors[ROUTES_KEY] = forced
    results = []
    for packing in (True, False):
        tr = trainer(moe, "r3", packing=packing)
        tr.router_replay.reset_metrics()
        results.append(tr.log_probs(batch))
        # a choice moved by one can still be the other recorded expert: agreement < 1
        assert tr.router_replay.metrics()["router/agreement"] < 0.75
    assert torch.allclose(results[0], results[1], atol=1e-6)
    mask = batch.tensors["response_mask"].bool()
    assert float((results[0] - own)[mask].abs().max()) > 1e-3


def test_router_gradient_equals_a_hand_written_moe_block() -> None:
    """One Qwen3-MoE block with forced routes R: y_t = sum_k g_tk E_{R_tk}(x_t), g = softmax(x
    W^T) at R, renormalised over k; E_e(x) = down_e(silu(gate_e x) * up_e x). The gradient of
    sum(y * c) reaching the router weight W (and the output) equals this formula's, and the
    routes differ from the block's own top-k (else the test would show nothing)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=8, moe_intermediate_size=4, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).double()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    c = torch.randn(1, 6, 8, dtype=torch.float64)
    routes = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 2], [0, 3], [2, 1]])
    _, _, own = block.gate(x.view(-1, 8))
    assert (own.sort(-1).values != routes.sort(-1).values).any(-1).sum() >= 3
    replay = RouterReplay(torch.nn.ModuleList([block]))
    replay.set(routes.view(1, 6, 1, 2).to(torch.int8))
    y = block(x)
    (y * c).sum().backward()
    got_w, got_y = block.gate.weight.grad.clone(), y.detach()

    w = block.gate.weight.detach().clone().requires_grad_(True)
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    xs = x.view(-1, 8)
    g = torch.softmax(xs @ w.T, dim=-1).gather(-1, routes)
    g = g / g.sum(-1, keepdim=True)
    rows = []
    for t in range(6):
        out = torch.zeros(8, dtype=torch.float64)
        for k in range(2):
            e = int(routes[t, k])
            h = gate_up[e] @ xs[t]
            out = out + g[t, k] * (down[e] @ (torch.nn.functional.silu(h[:4]) * h[4:]))
        rows.append(out)
    ref = torch.stack(rows).view(1, 6, 8)
    (ref * c).sum().backward()
    assert torch.allclose(got_y, ref.detach(), atol=1e-12)
    assert torch.allclose(got_w, w.grad, atol=1e-12)
    assert float(w.grad.abs().max()) > 1e-3


def test_routes_merge_and_fill() -> None:
    a = torch.tensor([[[1, 2]], [[3, 0]]], dtype=torch.int8)  # 2 tokens, 1 layer, k=2
    b = torch.tensor([[[0, 1]], [[1, 1]], [[2, 3]]], dtype=torch.int8)
    assert torch.equal(extend_routes(a, b), torch.cat([a, b[2:]]))  # first record wins
    assert extend_routes(a, b[:1]) is a and extend_routes(None, b) is b
    assert extend_routes(a, None) is a
    out = routes_tensor([a, None], [2, 3], 4)
    assert out is not None and out.shape == (2, 4, 1, 2)
    assert torch.equal(out[0, :2], a) and bool((out[0, 2:] == NO_ROUTE).all())
    assert bool((out[1] == NO_ROUTE).all())
    assert routes_tensor([None, None], [1, 1], 2) is None


def _recipe(tmp_path: Path, path: str, **sections: object):
    recipe = {
        "pipeline": "rlvr",
        "model": {"path": path},
        "data": {"train": {"path": str(ROOT / "data/tiny-arith/train.jsonl")}},
        "trainer": {"max_steps": 1},
        "algorithm": {"preset": "grpo", "router_replay": "r3"},
        **sections,
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return load_recipe(path, [])


def test_validation_refuses_what_cannot_replay(moe: str, tmp_path: Path) -> None:
    check_engine_support(_recipe(tmp_path, moe))  # MoE, hf engine, torch backend: fine
    with pytest.raises(ConfigError, match="dense model"):
        check_engine_support(_recipe(tmp_path, "builtin:tiny-qwen3"))
    with pytest.raises(ConfigError, match="Model Runner V2"):
        check_engine_support(_recipe(tmp_path, moe, actor_infer={"backend": "vllm"}))
    check_engine_support(_recipe(tmp_path, moe, actor_train={"backend": "megatron"}))
    recompute = {"path": moe, "gradient_checkpointing": True}
    with pytest.raises(ConfigError, match="recomputes the routers"):
        check_engine_support(
            _recipe(tmp_path, moe, actor_train={"backend": "megatron"}, model=recompute)
        )
    with pytest.raises(ConfigError, match="valid: off, r3|router_replay"):
        _recipe(tmp_path, moe, algorithm={"router_replay": "r2"})


@pytest.mark.slow
def test_roll_train_rlvr_with_replay(roll, tmp_path: Path) -> None:
    """`roll train rlvr` on a tiny Qwen3-MoE with the hf engine and replay on (packing on):
    the train/infer log-prob gap is fp32 noise, and the routing agreement is reported."""
    model = make_moe(tmp_path / "moe", std=0.3)
    recipe = {
        "pipeline": "rlvr",
        "name": "moe-r3",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": str(model)},
        "data": {
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": 32},
            "max_prompt_length": 64,
        },
        "rollout": {"n": 4, "prompts_per_step": 2, "max_new_tokens": 6},
        # KL (the reference replays too) and a rollout_correction section (an old log-prob
        # pass before the update, replayed): every trainer forward of the step
        "algorithm": {
            "preset": "grpo",
            "router_replay": "r3",
            "kl": {"coef": 0.01},
            "rollout_correction": {},
        },
        "trainer": {"max_steps": 2, "micro_batch_size": 4},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
        "actor_infer": {"num_threads": 1},
        "checkpoint": {"every_steps": 2, "keep_last": 1},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    res = roll("train", "rlvr", str(path), "--run-id", "moe-r3-00")
    assert res.returncode == 0, res.stderr
    lines = (tmp_path / "runs/moe-r3-00/metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if x.strip()]
    trained = [s for s in steps if "router/agreement" in s]
    assert len(trained) == 2, steps
    for s in trained:
        assert s["train_infer/logprob_diff"] < 1e-5, s
        assert 0.9 <= s["router/agreement"] <= 1.0
        assert "router/agreement_layer01" in s
        assert "rollout_corr/kl" in s
    # step 1: the reference is the policy, replaying the same routes: no KL but fp32 noise
    assert abs(trained[0]["actor/kl_loss"]) < 1e-5, trained[0]


def test_gradient_checkpointing_recomputes_with_the_same_routes(moe: str) -> None:
    """With activation checkpointing the backward recomputes each layer's forward: the
    replayed routes are looked up by router, not by call order, so the recompute routes as the
    forward did and the update equals the one without checkpointing."""
    prompts, done = sampled(moe)
    batch = rl_batch(prompts, done)
    forced = batch.tensors[ROUTES_KEY].clone()
    recorded = forced != NO_ROUTE
    forced[recorded] = (forced[recorded].long() + 1).remainder(4).to(forced.dtype)
    batch.tensors[ROUTES_KEY] = forced
    batch.tensors["loss_mask"] = batch.tensors["attention_mask"].clone()
    batch.meta["loss_tokens"] = int(batch.tensors["loss_mask"][:, 1:].sum())
    norms = []
    for checkpointing in (False, True):
        tr = TorchTrainBackend(
            TrainBackendSpec(
                model_path=moe, device="cpu", router_replay="r3", micro_batch_size=2, seed=0,
                num_threads=1, gradient_checkpointing=checkpointing,
            )
        )  # fmt: skip
        norms.append(tr.train_step(batch, sft)["train/grad_norm"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)


def test_agentic_rows_carry_the_routes_of_their_tokens() -> None:
    """A trajectory row: the trace's routes (first record of each token wins across turns);
    a step row: its turn's own; NO_ROUTE past them."""
    from roll_core.rollout.agentic.batch import step_batch, trajectory_batch
    from roll_core.rollout.agentic.episode import Trajectory, Turn

    def r(*experts: int) -> torch.Tensor:
        return torch.tensor([[[e, e]] for e in experts], dtype=torch.int8)  # [N, 1, 2]

    traj = Trajectory(tag="t", group=0, seed=0, index=0, status="done")
    traj.trace.add_context([1, 2, 3])
    traj.trace.add_routes(r(0, 0, 0, 0), [1, 2, 3])  # turn 1: prompt 3 + response 2 - 1
    traj.trace.add_generated([4, 5], [-0.1, -0.2])
    traj.trace.add_context([6])
    traj.trace.add_routes(r(1, 1, 1, 1, 1, 1, 1), [1, 2, 3, 4, 5, 6])  # recomputed prefix
    traj.trace.add_generated([7, 8], [-0.3, -0.4])
    traj.trace.add_routes(r(2, 2), [9])  # not this trace's continuation: ignored
    turn = dict(finish_reason="stop", policy_version=0, action="", reward=1.0, state_key="s",
                action_is_valid=True, gen_s=0.0, env_s=0.0)  # fmt: skip
    traj.turns = [
        Turn([1, 2, 3], [4, 5], [-0.1, -0.2], routed_experts=r(0, 0, 0, 0), **turn),
        Turn([1, 2, 3, 4, 5, 6], [7, 8], [-0.3, -0.4], routed_experts=r(*[1] * 7), **turn),
    ]
    other = Trajectory(tag="t", group=0, seed=1, index=1, status="done")
    other.trace.add_context([1])
    other.trace.add_generated([2], [-0.5])
    other.turns = [Turn([1], [2], [-0.5], **turn)]
    rows = trajectory_batch([[traj, other]], pad_id=0)
    routes = rows.tensors[ROUTES_KEY][:, :, 0, 0].tolist()
    assert routes[0] == [0, 0, 0, 0, 1, 1, 1, NO_ROUTE]  # 4 first-turn, 3 new, the last none
    assert routes[1] == [NO_ROUTE] * 8
    steps = step_batch([[traj]], pad_id=0)
    assert steps.tensors[ROUTES_KEY][:, :, 0, 0].tolist() == [
        [0, 0, 0, 0, NO_ROUTE, NO_ROUTE, NO_ROUTE, NO_ROUTE],
        [1, 1, 1, 1, 1, 1, 1, NO_ROUTE],
    ]


@pytest.mark.slow
def test_roll_train_agentic_with_replay(roll, tmp_path: Path) -> None:
    """`roll train agentic` (multi-turn trajectories, packing on) on the tiny Qwen3-MoE with
    replay: the train/infer gap is fp32 noise and the agreement is reported."""
    model = make_moe(tmp_path / "moe", std=0.3)
    recipe = {
        "pipeline": "agentic",
        "name": "moe-r3-agentic",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": str(model)},
        "envs": [
            {
                "env": "frozen_lake",
                "options": {"size": 3, "max_steps": 3},
                "system_prompt": "Lake.",
                "groups_per_step": 2,
                "eval_episodes": 2,
            }
        ],
        "rollout": {"group_size": 2, "max_new_tokens": 4},
        "algorithm": {"preset": "grpo", "kl": {"coef": 0.0}, "router_replay": "r3"},
        "trainer": {"max_steps": 1, "micro_batch_size": 8},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
        "actor_infer": {"num_threads": 1},
        "eval": {"every_steps": None},
        "checkpoint": {"every_steps": 1, "keep_last": 1},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    res = roll("train", "agentic", str(path), "--run-id", "moe-ag", timeout=300)
    assert res.returncode == 0, res.stderr + res.stdout
    lines = (tmp_path / "runs/moe-ag/metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if x.strip()]
    trained = [s for s in steps if "router/agreement" in s]
    assert len(trained) == 1, steps
    assert trained[0]["train_infer/logprob_diff"] < 1e-5, trained[0]
    assert 0.9 <= trained[0]["router/agreement"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_sharded_ranks_replay_as_one_process(moe: str, backend: str) -> None:
    """Two fsdp2 / DeepSpeed ZeRO-3 ranks (the same HF forward, its routers hooked) replaying
    routes that differ from their own: the step's gradient norm and agreement are those of
    the one-process torch backend."""
    from roll_core.config.schema import DeepSpeedConfig
    from roll_core.engine import Cluster, LocalExecutor
    from roll_core.workers.actor_train import ActorTrain

    if backend == "deepspeed":
        pytest.importorskip("deepspeed", reason="needs the deepspeed extra")
    prompts, done = sampled(moe, n=3)
    batch = rl_batch([*prompts, prompts[1]], [*done, done[1]])  # 4 rows: 2 per rank
    forced = batch.tensors[ROUTES_KEY].clone()
    recorded = forced != NO_ROUTE
    forced[recorded] = (forced[recorded].long() + 1).remainder(4).to(forced.dtype)
    batch.tensors[ROUTES_KEY] = forced
    batch.tensors["loss_mask"] = batch.tensors["attention_mask"].clone()
    batch.meta["loss_tokens"] = int(batch.tensors["loss_mask"][:, 1:].sum())
    common = dict(
        model_path=moe, device="cpu", router_replay="r3", micro_batch_size=2, seed=0,
        num_threads=1, precision="fp32",
    )  # fmt: skip
    options = {"deepspeed": DeepSpeedConfig(zero_stage=3)} if backend == "deepspeed" else {}
    results = []
    for size, spec in [
        (1, TrainBackendSpec(**common)),
        (2, TrainBackendSpec(backend=backend, **common, **options)),
    ]:
        ex = LocalExecutor()
        try:
            actor = Cluster(
                "actor_train", ActorTrain, ex, world_size=size, worker_kwargs={"spec": spec}
            )
            actor.run("setup")
            results.append(actor.train_step(batch, objective="sft"))
        finally:
            ex.shutdown()
    expected, two = results
    assert expected["router/agreement"] < 0.75
    assert two["router/agreement"] == pytest.approx(expected["router/agreement"], rel=1e-6)
    assert two["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)


def test_generation_after_a_replayed_step_routes_itself(moe: str) -> None:
    """The routes of the last replayed forward stay set (for a checkpointed backward), but
    ActorTrain.generate (greedy evaluation) has none recorded: it routes itself."""
    from roll_core.workers.actor_train import ActorTrain

    prompts, done = sampled(moe, n=2)
    batch = rl_batch(prompts, done)
    worker = ActorTrain(spec=TrainBackendSpec(model_path=moe, device="cpu", router_replay="r3"))
    worker.setup()
    worker.backend.log_probs(batch)  # leaves this batch's routes set
    assert worker.backend.router_replay._routes is not None
    out = worker.generate([[5, 6, 7]], max_new_tokens=3)
    assert len(out) == 1 and len(out[0]) <= 3


def test_roll_refuses_replay_on_a_dense_model(roll, tmp_path: Path) -> None:
    """The CLI: exit code 2, the one-paragraph message with its hint, no traceback."""
    recipe = {
        "pipeline": "rlvr",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {"train": {"path": str(ROOT / "data/tiny-arith/train.jsonl")}},
        "trainer": {"max_steps": 1},
        "algorithm": {"preset": "grpo", "router_replay": "r3"},
    }
    path = tmp_path / "dense.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = roll("train", "rlvr", str(path), "--dry-run")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "is a dense model" in res.stderr and "router_replay: off" in res.stderr
    assert "Traceback" not in res.stderr


def test_replay_removes_the_routing_part_of_a_bf16_samplers_gap(moe: str) -> None:
    """A bf16 sampler (hf engine, autocast) against the fp32 trainer: some routing choices
    flip (agreement < 1); replaying the sampler's routes shrinks the log-prob gap (what is
    left is bf16 rounding; docs/scaling.md has a case where the maximum drops 0.50 -> 0.18)."""
    engine = HFInferBackend(model_path=moe, device="cpu", record_routes=True, precision="bf16")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (12,), generator=g).tolist() for _ in range(16)]
    params = SamplingParams(max_new_tokens=32, temperature=1.0)
    done = engine.generate([Request(i, p, seed=i) for i, p in enumerate(prompts)], params)
    batch = rl_batch(prompts, done)
    mask = batch.tensors["response_mask"].bool()
    gaps, agreement = {}, 1.0
    for mode in ("off", "r3"):
        tr = trainer(moe, mode)
        gap = (tr.log_probs(batch) - batch.tensors["behaviour_log_probs"]).abs()[mask]
        gaps[mode] = (float(gap.mean()), float(gap.max()))
        if tr.router_replay is not None:
            agreement = tr.router_replay.metrics()["router/agreement"]
    assert agreement < 1.0
    assert gaps["r3"][0] < gaps["off"][0] and gaps["r3"][1] <= gaps["off"][1], gaps


def test_the_reference_replays_the_same_routes(moe: str) -> None:
    """The plain-model reference (KL) with r3 routes through the recorded experts as the
    trainer does: the same log-probs for routes that differ from its own choice."""
    from roll_core.workers.reference import Reference

    prompts, done = sampled(moe)
    batch = rl_batch(prompts, done)
    forced = batch.tensors[ROUTES_KEY].clone()
    recorded = forced != NO_ROUTE
    forced[recorded] = (forced[recorded].long() + 1).remainder(4).to(forced.dtype)
    batch.tensors[ROUTES_KEY] = forced
    expected = trainer(moe, "r3").log_probs(batch)
    found = {}
    for mode in ("off", "r3"):
        ref = Reference(model_path=moe, device="cpu", packing=True, router_replay=mode)
        ref.setup()
        found[mode] = ref.log_probs(batch)
    assert torch.allclose(found["r3"], expected, atol=1e-6)
    mask = batch.tensors["response_mask"].bool()
    assert float((found["off"] - expected)[mask].abs().max()) > 1e-3
