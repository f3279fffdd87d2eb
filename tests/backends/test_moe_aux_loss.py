"""The router's load-balancing loss of a mixture-of-experts model (Qwen3-MoE with
`output_router_logits`): the train backend adds `router_aux_loss_coef * aux_loss` to the
objective, as transformers adds it to its own loss, and logs `actor/router_aux_loss`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.torch_backend import TorchTrainBackend, token_loss_sum
from roll_core.config.schema import OptimConfig
from roll_core.data import Batch
from roll_core.models import materialize_builtin
from roll_core.workers.objectives import sft

COEF = 2.0  # large, so that the term moves the gradient well beyond the tolerance


def make_moe(directory: Path, **config: object) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    tiny = dict(
        vocab_size=256,
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
        router_aux_loss_coef=COEF,
    )
    cfg = Qwen3MoeConfig(**{**tiny, **config})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {
        "router": str(make_moe(root / "router", output_router_logits=True)),
        "tokenizer": str(materialize_builtin("tiny-qwen3", root / "cache")),
    }


def backend(dirs: dict[str, str], model: str, micro: int) -> TorchTrainBackend:
    return TorchTrainBackend(
        TrainBackendSpec(
            model_path=dirs[model],
            tokenizer_path=dirs["tokenizer"],
            device="cpu",
            optim=OptimConfig(lr=1e-2),
            total_steps=10,
            micro_batch_size=micro,
            seed=0,
            num_threads=1,
        )
    )


def batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (4, 10), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0  # a padded row
    mask = attn.clone()
    mask[:, :3] = 0  # the prompt
    b = Batch(
        tensors={"input_ids": ids, "attention_mask": attn, "loss_mask": mask},
        non_tensors={},
        meta={},
    )
    b.meta["loss_tokens"] = int(mask[:, 1:].sum())
    return b


def hf_reference(path: str, chunks: list[Batch], tokens: int) -> tuple[float, float, float]:
    """transformers' own loss on the same rows, summed over micro-batches as the backend
    weights them (each micro-batch's CE sum over the global trained tokens, plus COEF times
    its aux loss times its share of the rows): (gradient norm, same without the router term,
    row-weighted mean aux_loss)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    rows = sum(len(c) for c in chunks)
    ce_total, aux_total = torch.zeros(()), torch.zeros(())
    for c in chunks:
        t = c.tensors
        labels = torch.where(t["loss_mask"].bool(), t["input_ids"], -100)
        out = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], labels=labels)
        n = int(t["loss_mask"][:, 1:].sum())
        ce = token_loss_sum(out.logits, t["input_ids"], t["loss_mask"]) / n
        # transformers' own loss: the token-mean cross-entropy + coef * aux_loss
        assert float(out.loss.detach()) == pytest.approx(
            float((ce + COEF * out.aux_loss).detach()), rel=1e-6
        )
        ce_total = ce_total + ce * n / tokens
        aux_total = aux_total + out.aux_loss * len(c) / rows

    def norm(loss: torch.Tensor) -> float:
        model.zero_grad()
        loss.backward(retain_graph=True)
        return float(torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())))

    return norm(ce_total + COEF * aux_total), norm(ce_total), float(aux_total.detach())


@pytest.mark.parametrize("micro", [4, 2])
def test_router_aux_loss_is_added_as_transformers_does(dirs: dict[str, str], micro: int) -> None:
    b = batch()
    expected, without, aux = hf_reference(dirs["router"], b.chunk(micro), b.meta["loss_tokens"])
    assert abs(expected - without) > 1e-3 * expected  # 10x the tolerance below
    metrics = backend(dirs, "router", micro).train_step(b, sft)
    assert metrics["train/grad_norm"] == pytest.approx(expected, rel=1e-4)
    assert metrics["actor/router_aux_loss"] == pytest.approx(aux, rel=1e-5)


def test_roll_sft_logs_the_router_aux_loss(roll, tiny_recipe, tmp_path: Path) -> None:
    import json
    import shutil

    model = make_moe(tmp_path / "moe", vocab_size=320, output_router_logits=True)
    tokenizer = Path(materialize_builtin("tiny-qwen3", tmp_path / "cache"))
    for f in tokenizer.glob("*"):
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, model / f.name)
    recipe = tiny_recipe(
        model={"path": str(model)},
        trainer={"max_steps": 2, "micro_batch_size": 8, "grad_accum_steps": 1},
        eval={"every_steps": 2, "exact_match": False},
        checkpoint={"every_steps": 2, "keep_last": 1},
    )
    r = roll("sft", str(recipe), "--run-id", "moe-aux-00")
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "runs/moe-aux-00/metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if line.strip()]
    aux = [s["actor/router_aux_loss"] for s in steps if "train/loss" in s]
    # transformers' balance loss: num_experts * sum_k,e f_ke * P_e (f: the share of tokens whose
    # k-th choice is expert e, P: the mean router probability of e). A near-uniform random
    # router gives f_ke = P_e = 1/4 for each of the top-2 choices: 4 * 2 * 4 * (1/16) = 2
    assert len(aux) == 2 and all(1.9 < a < 2.2 for a in aux), aux


def test_fsdp2_ranks_add_the_same_term(dirs: dict[str, str]) -> None:
    """Two fsdp2 ranks (one micro-batch of 2 rows each) against one process with micro-batches
    of 2 rows: each micro-batch's term is weighted 1/2 either way."""
    from roll_core.engine import Cluster, LocalExecutor
    from roll_core.engine.dispatch import reduce_rank_metrics
    from roll_core.workers.actor_train import ActorTrain

    b = batch()
    b.tensors["attention_mask"][:] = 1  # equal rows: the ranks get rows 0-1 and 2-3
    b.tensors["loss_mask"] = b.tensors["attention_mask"].clone()
    b.tensors["loss_mask"][:, :3] = 0
    b.meta["loss_tokens"] = int(b.tensors["loss_mask"][:, 1:].sum())
    one = backend(dirs, "router", 2).train_step(b, sft)
    kwargs = dict(
        model_path=dirs["router"],
        tokenizer_path=dirs["tokenizer"],
        optim=OptimConfig(lr=1e-2),
        total_steps=10,
        micro_batch_size=2,
        seed=0,
        num_threads=1,
        device="cpu",
        precision="fp32",
    )
    ex = LocalExecutor()
    try:
        actor = Cluster(
            "actor_train",
            ActorTrain,
            ex,
            world_size=2,
            worker_kwargs={"spec": TrainBackendSpec(backend="fsdp2", **kwargs)},
        )
        actor.run("setup")
        two = reduce_rank_metrics(actor.run_dp("train_step", b))
    finally:
        ex.shutdown()
    assert two["actor/router_aux_loss"] == pytest.approx(one["actor/router_aux_loss"], rel=1e-5)
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-5)
