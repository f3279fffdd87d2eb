"""`roll eval` through the real CLI on the built-in tiny model."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from roll_core.models.builtin import materialize_builtin
from roll_core.runs import Run

ROOT = Path(__file__).resolve().parents[2]
DATA = str(ROOT / "data/tiny-arith/test.jsonl")

PARITY = '''
from roll_core.rewards import RewardResult


def parity(sample):
    """Correct when the decoded response's code points sum to an even number."""
    ok = sum(map(ord, sample.response)) % 2 == 0
    return RewardResult(float(ok), {"correct": ok})
'''


def parity_ok(text: str) -> bool:
    return sum(map(ord, text)) % 2 == 0


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sampled_eval_with_a_user_reward(roll, tmp_path: Path) -> None:
    (tmp_path / "parity_reward.py").write_text(PARITY)
    args = ["eval", "builtin:tiny-qwen3", "--data", DATA, "--max-rows", "6", "--n", "4"]
    args += ["--temperature", "1.0", "--max-new-tokens", "3", "--reward", "parity_reward:parity"]
    res = roll(*args, "--out", "a.jsonl", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = read_jsonl(tmp_path / "a.jsonl")
    assert [r["index"] for r in rows] == list(range(6))
    assert rows[0]["prompt"].endswith("What is 75 - 42?<|im_end|>\n<|im_start|>assistant\n")
    for row in rows:
        assert len(row["responses"]) == 4 and all(1 <= n <= 3 for n in row["lengths"])
        # the reward saw exactly the text written out
        assert row["correct"] == [parity_ok(t) for t in row["responses"]]
        assert row["num_correct"] == sum(row["correct"])
    metrics = json.loads((tmp_path / "a.summary.json").read_text())["metrics"]
    counts = [r["num_correct"] for r in rows]
    assert metrics["accuracy"] == pytest.approx(sum(counts) / 24)
    for k in (1, 2, 4):  # Chen et al.: 1 - C(n-c, k) / C(n, k), averaged over prompts
        expected = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in counts) / 6
        assert metrics[f"pass@{k}"] == pytest.approx(expected)
    lengths = [n for r in rows for n in r["lengths"]]
    assert metrics["response_length_mean"] == pytest.approx(sum(lengths) / 24)
    assert f"accuracy {metrics['accuracy']:.4g}" in res.stdout
    assert "per-row results: a.jsonl" in res.stdout
    # seeded per request: the same command gives the same answers
    again = roll(*args, "--out", "b.jsonl", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()


def test_eval_of_a_run_uses_its_settings(roll, tmp_path: Path, cache_dir: Path) -> None:
    config = (
        "pipeline: rlvr\ndata: {prompt_key: question, answer_key: gold, system_prompt: Be brief.}\n"
        "rollout: {max_new_tokens: 2}\nreward: {domains: {math: math}}\n"
    )
    run = Run.create(
        tmp_path / "runs",
        config_yaml=config,
        name="t",
        pipeline="rlvr",
        command=[],
        recipe=None,
        run_id="my-run",
    )
    shutil.copytree(materialize_builtin("tiny-qwen3", cache_dir), run.dir / "final")
    data = tmp_path / "q.jsonl"
    rows = [
        {"question": "What is 1 + 1?", "gold": "2"},
        {"question": "What is 2 + 5?", "gold": "7"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = roll("eval", "my-run", "--data", str(data), "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr
    assert "model: run my-run (final)" in res.stdout
    out = run.dir / "eval" / "q.jsonl"
    assert f"per-row results: {out}" in res.stdout
    written = read_jsonl(out)
    assert written[0]["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert [r["answer"] for r in written] == ["2", "7"]
    assert all(len(r["responses"]) == 1 and r["lengths"][0] <= 2 for r in written)
    summary = json.loads((run.dir / "eval" / "q.summary.json").read_text())
    assert summary["settings"]["max_new_tokens"] == 2 and summary["settings"]["temperature"] == 0
    assert summary["metrics"]["pass@1"] == summary["metrics"]["accuracy"]


@pytest.mark.parametrize(
    ("args", "message"),
    [  # the n / temperature / top-p checks: tests/evaluation/test_evaluate.py
        (["no-such-run", "--data", DATA], "'no-such-run' is not a run"),
        (["builtin:tiny-qwen3", "--data", "missing.jsonl"], "--data: no file or directory"),
        (["builtin:tiny-qwen3", "--data", DATA, "--reward", "maths"], "did you mean 'math'"),
        (["builtin:tiny-qwen3", "--data", DATA, "--n", "4", "--temperature", "0"], "greedy"),
        (["builtin:tiny-qwen3", "--data", DATA, "--prompt-key", "q"], "has no column 'q'"),
    ],
)
def test_bad_input_exits_2_with_one_message(roll, tmp_path: Path, args, message) -> None:
    res = roll("eval", *args, "--runs-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr
    assert res.stderr.startswith("error:")


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None, reason="vLLM is not installed"
)
@pytest.mark.extended  # vLLM generation against HF is checked by tests/backends/test_vllm*.py
def test_vllm_backend_gives_the_hf_greedy_answers(roll, tmp_path: Path) -> None:
    common = ["eval", "builtin:tiny-qwen3", "--data", DATA, "--max-rows", "4"]
    common += ["--max-new-tokens", "4", "--reward", "format"]
    hf = roll(*common, "--out", "hf.jsonl", cwd=tmp_path)
    vl = roll(*common, "--backend", "vllm", "--out", "vllm.jsonl", cwd=tmp_path, timeout=900)
    assert hf.returncode == 0 and vl.returncode == 0, hf.stderr + vl.stderr
    hf_rows, vllm_rows = read_jsonl(tmp_path / "hf.jsonl"), read_jsonl(tmp_path / "vllm.jsonl")
    assert [r["lengths"] for r in hf_rows] == [r["lengths"] for r in vllm_rows]
    assert [r["responses"] for r in hf_rows] == [r["responses"] for r in vllm_rows]
    metrics = json.loads((tmp_path / "vllm.summary.json").read_text())["metrics"]
    assert "accuracy" not in metrics and "reward_mean" in metrics  # format grades nothing
