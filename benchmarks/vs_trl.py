"""roll against TRL's GRPOTrainer on the same small GRPO setup, in one command.

Same start model (the built-in tiny Qwen3 after a short, cached SFT warm start on tiny-arith),
same data (data/tiny-arith), same reward (exact match of the stripped response with the
answer), same hyper-parameters: 16 prompts x 8 samples per step, at most 6 new tokens,
temperature 1, AdamW lr 2e-5 betas (0.9, 0.999), constant LR, grad-norm clip 1, clip 0.2, no
KL, group-std advantage scaling (eps 1e-4), token-mean loss over the batch (TRL's `dapo`), one
optimizer step per batch in micro-batches of 32. TRL runs in its own virtualenv
(.cache/bench-trl-venv: `pip install -c constraints-cpu.txt torch==2.13.0 trl
transformers==<roll's>`, made on first use), so its dependencies never touch roll's.

For each seed both arms run back to back, alternating which goes first (a shared machine's
load then hits both alike), each as its own process with the same torch thread count. Printed
per seed and on average: completions/s (completions of steps 2..N divided by their wall time,
so model loading, imports and the first step's warm-up are out for both), the ratio roll/TRL,
and held-out accuracy after N steps (greedy, the first --eval-rows test prompts, scored by the
same code for both models).

    python benchmarks/vs_trl.py [--steps 30] [--seeds 0 1 2] [--threads 2]

Not a test: timings are wall clock on whatever machine runs it (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
VENV = CACHE / "bench-trl-venv"
DATA = ROOT / "data" / "tiny-arith"
PROMPTS, N, NEW_TOKENS, MICRO, LR = 16, 8, 6, 32, 2e-5


def env(threads: int) -> dict[str, str]:
    e = dict(os.environ)
    e.update(
        OMP_NUM_THREADS=str(threads),
        OMP_WAIT_POLICY="PASSIVE",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONPATH=str(ROOT),
    )
    return e


def run(args: list[str], threads: int) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(args, env=env(threads), cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"failed: {' '.join(args)}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def ensure_trl_venv() -> Path:
    """TRL in its own virtualenv, with roll's torch and transformers versions pinned."""
    import transformers

    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {VENV} (TRL and its dependencies; torch pinned) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pins = ["torch==2.13.0", "trl", f"transformers=={transformers.__version__}"]
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints-cpu.txt")]
            + pins,
            check=True,
        )
    probe = "import trl, transformers, torch; print(trl.__version__, transformers.__version__, torch.__version__)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    trl_v, tf_v, torch_v = out.stdout.split()
    if tf_v != transformers.__version__:
        sys.exit(f"{VENV} has transformers {tf_v}, roll {transformers.__version__}: remove it")
    print(f"TRL {trl_v} (transformers {tf_v}, torch {torch_v}) in {VENV}")
    return python


def warm_start(steps: int, threads: int) -> Path:
    final = CACHE / "bench-vs-trl" / f"sft-{steps}" / "final"
    if (final / "model.safetensors").exists():
        print(f"warm start: cached {final}")
        return final
    print(f"warm start: {steps} SFT steps of the tiny model on tiny-arith ...", flush=True)
    run(
        [
            str(Path(sys.executable).with_name("roll")),
            "sft",
            str(ROOT / "recipes" / "tiny-arith-sft.yaml"),
            f"trainer.max_steps={steps}",
            "eval.every_steps=null",
            "checkpoint.every_steps=null",
            f"runs_dir={CACHE / 'bench-vs-trl'}",
            "tracking.backends=[jsonl]",
            f"actor_train.num_threads={threads}",
            "--run-id",
            f"sft-{steps}",
        ],
        threads,
    )
    return final


def roll_arm(model: Path, seed: int, steps: int, threads: int, work: Path) -> dict[str, float]:
    import yaml

    recipe = {
        "pipeline": "rlvr",
        "name": "vs-trl",
        "seed": seed,
        "runs_dir": str(work),
        "model": {"path": str(model)},
        "data": {"train": {"path": str(DATA / "train.jsonl")}, "max_prompt_length": 64},
        "rollout": {
            "n": N,
            "prompts_per_step": PROMPTS,
            "max_new_tokens": NEW_TOKENS,
            "temperature": 1.0,
            # one generate call per step, as TRL makes
            "deterministic": True,
            "chunk_size": PROMPTS * N,
            "max_chunks_in_flight": 1,
        },
        "algorithm": {
            "preset": "grpo",
            "kl": {"coef": 0.0},
            "adv_eps": 1e-4,
            "loss_agg_mode": "token-mean",
        },
        "reward": {"domains": {"math": "exact_match"}, "isolation": "thread"},
        "trainer": {"max_steps": steps, "micro_batch_size": MICRO},
        "actor_train": {
            "num_threads": threads,
            "optim": {
                "lr": LR,
                "betas": [0.9, 0.999],
                "scheduler": "constant",
                "warmup_steps": 0,
                "max_grad_norm": 1.0,
            },
        },
        "actor_infer": {"num_threads": threads},
        "checkpoint": {"every_steps": None},
        "tracking": {"backends": ["jsonl"]},
    }
    path = work / f"roll-{seed}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    run_id = f"roll-{seed}"
    run(
        [
            str(Path(sys.executable).with_name("roll")),
            "train",
            "rlvr",
            str(path),
            "--run-id",
            run_id,
        ],
        threads,
    )
    rows = [json.loads(x) for x in (work / run_id / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in sorted(rows, key=lambda r: r["step"]) if "actor/pg_loss" in r]
    times = [r["time"] for r in steps]
    return {
        "completions_per_s": (len(times) - 1) * PROMPTS * N / (times[-1] - times[0]),
        "completions_per_cpu_s": (len(steps) - 1)
        * PROMPTS
        * N
        / (steps[-1]["perf/process_cpu_total_s"] - steps[0]["perf/process_cpu_total_s"]),
        "step_s": statistics.median(b - a for a, b in zip(times, times[1:], strict=False)),
        "generate_s": statistics.median(r["rollout/gen_active_s"] for r in steps[1:]),
        "model": str(work / run_id / "final"),
    }


def trl_arm(
    python: Path, model: Path, seed: int, steps: int, threads: int, work: Path
) -> dict[str, float]:
    out = work / f"trl-{seed}"
    args = {"model": str(model), "seed": seed, "steps": steps, "threads": threads, "out": str(out)}
    res = run([str(python), __file__, "--trl-worker", json.dumps(args)], threads)
    result = json.loads(res.stdout.strip().splitlines()[-1])
    return {**result, "model": str(out / "final")}


def trl_worker(spec: dict) -> None:
    """Runs inside the TRL virtualenv: GRPOTrainer with the benchmark's settings."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    rows = [json.loads(x) for x in (DATA / "train.jsonl").read_text().splitlines()]
    data = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in rows
        ]
    )

    def exact_match(completions: list, answer: list, **_: object) -> list[float]:
        return [
            1.0 if c[0]["content"].strip() == str(a).strip() else 0.0
            for c, a in zip(completions, answer, strict=True)
        ]

    stamps: list[float] = []
    cpu: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

    config = GRPOConfig(
        output_dir=spec["out"],
        seed=spec["seed"],
        max_steps=spec["steps"],
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=PROMPTS * N // MICRO,  # one optimizer step per generation
        num_generations=N,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=exact_match,
        args=config,
        train_dataset=data,
        callbacks=[Stamp()],
    )
    gen: list[float] = []
    generate = trainer.model.generate

    def timed_generate(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        gen.append(time.perf_counter() - start)
        return out

    trainer.model.generate = timed_generate  # TRL generates with this model object on CPU
    trainer.train()
    trainer.save_model(str(Path(spec["out"]) / "final"))
    rate = (len(stamps) - 1) * PROMPTS * N / (stamps[-1] - stamps[0])
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    print(
        json.dumps(
            {
                "completions_per_s": rate,
                "completions_per_cpu_s": (len(cpu) - 1) * PROMPTS * N / (cpu[-1] - cpu[0]),
                "step_s": statistics.median(steps),
                "generate_s": statistics.median(gen[1:]) if len(gen) > 1 else float("nan"),
            }
        )
    )


def accuracy(model: str, rows: list[dict], threads: int) -> float:
    """Greedy answers of `model` to `rows`, exact match after strip (the training reward)."""
    from roll_core.backends.infer import Request, SamplingParams
    from roll_core.backends.infer.hf import HFInferBackend
    from roll_core.data import encode_prompt

    backend = HFInferBackend(model_path=model, device="cpu", num_threads=threads)
    tok = backend.tokenizer
    reqs = [Request(i, encode_prompt(tok, r["prompt"]), seed=i) for i, r in enumerate(rows)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    done = [
        c for k in range(0, len(reqs), 100) for c in backend.generate(reqs[k : k + 100], params)
    ]
    right = sum(
        tok.decode(c.response_ids, skip_special_tokens=True).strip() == str(r["answer"]).strip()
        for c, r in zip(done, rows, strict=True)
    )
    return right / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each arm")
    ap.add_argument("--sft-steps", type=int, default=600, help="warm start (cached)")
    ap.add_argument("--eval-rows", type=int, default=300)
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_worker:
        return trl_worker(json.loads(a.trl_worker))
    python = ensure_trl_venv()
    model = warm_start(a.sft_steps, a.threads)
    work = CACHE / "bench-vs-trl" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True)
    test = [json.loads(x) for x in (DATA / "test.jsonl").read_text().splitlines()][: a.eval_rows]
    print(f"start model accuracy: {accuracy(str(model), test, a.threads):.3f}", flush=True)
    print(
        f"{'seed':>4} {'roll c/s':>9} {'TRL c/s':>8} {'ratio':>6} {'roll acc':>9} {'TRL acc':>8}"
        f" {'roll c/cpu-s':>13} {'TRL c/cpu-s':>12} {'ratio':>6}"
    )
    results = []
    for k, seed in enumerate(a.seeds):
        arms = {
            "roll": lambda s=seed: roll_arm(model, s, a.steps, a.threads, work),
            "trl": lambda s=seed: trl_arm(python, model, s, a.steps, a.threads, work),
        }
        order = ["roll", "trl"] if k % 2 == 0 else ["trl", "roll"]
        got = {name: arms[name]() for name in order}
        for name in got:
            got[name]["accuracy"] = accuracy(got[name]["model"], test, a.threads)
        r, t = got["roll"], got["trl"]
        ratio = r["completions_per_s"] / t["completions_per_s"]
        cpu_ratio = r["completions_per_cpu_s"] / t["completions_per_cpu_s"]
        results.append((r, t, ratio, cpu_ratio))
        print(
            f"{seed:>4} {r['completions_per_s']:>9.1f} {t['completions_per_s']:>8.1f} "
            f"{ratio:>6.2f} {r['accuracy']:>9.3f} {t['accuracy']:>8.3f} "
            f"{r['completions_per_cpu_s']:>13.1f} {t['completions_per_cpu_s']:>12.1f} "
            f"{cpu_ratio:>6.2f}   median step s (generate s): "
            f"roll {r['step_s']:.3f} ({r['generate_s']:.3f}), "
            f"TRL {t['step_s']:.3f} ({t['generate_s']:.3f})",
            flush=True,
        )
    mean = statistics.mean
    print(
        f"mean {mean(r['completions_per_s'] for r, *_ in results):>9.1f} "
        f"{mean(t['completions_per_s'] for _, t, *_ in results):>8.1f} "
        f"{mean(x[2] for x in results):>6.2f} "
        f"{mean(r['accuracy'] for r, *_ in results):>9.3f} "
        f"{mean(t['accuracy'] for _, t, *_ in results):>8.3f} "
        f"{mean(r['completions_per_cpu_s'] for r, *_ in results):>13.1f} "
        f"{mean(t['completions_per_cpu_s'] for _, t, *_ in results):>12.1f} "
        f"{mean(x[3] for x in results):>6.2f}"
    )
    print(f"runs in {work}; {os.cpu_count()} CPUs visible, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
