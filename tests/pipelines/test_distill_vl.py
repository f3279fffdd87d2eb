"""`roll distill` with a vision-language teacher and student on image rows (data/tiny-shapes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "data" / "tiny-shapes"
RECIPE = ROOT / "recipes" / "tiny-vl-distill.yaml"


def overrides(tmp_path: Path) -> list[str]:
    return [
        f"runs_dir={tmp_path / 'runs'}",
        f"data.train.path={SHAPES / 'train.jsonl'}",
        "data.train.max_rows=64",
        f"data.eval.path={SHAPES / 'test.jsonl'}",
        "data.eval.max_rows=16",
        "trainer.max_steps=4",
        "trainer.micro_batch_size=16",
        "trainer.log_every_steps=1",
        "eval.every_steps=4",
        "eval.batch_size=16",
        "actor_train.num_threads=1",
        "tracking.backends=[jsonl]",
    ]


def test_vl_distill_runs_and_lowers_kl(roll, tmp_path: Path) -> None:
    res = roll("distill", str(RECIPE), *overrides(tmp_path), "--run-id", "vld")
    assert res.returncode == 0, res.stderr + res.stdout
    rows = [json.loads(x) for x in (tmp_path / "runs/vld/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/kl" in r]
    assert [r["step"] for r in evals] == [0, 4]
    assert evals[1]["eval/kl"] < evals[0]["eval/kl"]
    assert "eval/teacher_exact_match" in evals[0]  # the teacher generated from the images too
    assert "teacher: 3,522,240 parameters" in res.stderr
    assert (tmp_path / "runs/vld/final/preprocessor_config.json").is_file()


def test_teacher_processor_that_disagrees_is_refused(roll, cache_dir: Path, tmp_path: Path) -> None:
    from roll_core.models import materialize_builtin

    teacher = tmp_path / "teacher"
    shutil.copytree(materialize_builtin("small-qwen2.5-vl", cache_dir), teacher)
    config_file = teacher / "preprocessor_config.json"
    config = json.loads(config_file.read_text())
    config["size"]["longest_edge"] = 28 * 28 * 4
    config_file.write_text(json.dumps(config))
    res = roll("distill", str(RECIPE), *overrides(tmp_path), f"teacher.path={teacher}")
    assert res.returncode == 2, res.stderr + res.stdout
    assert "process images differently (student vs teacher): size" in res.stderr
    assert "'longest_edge': 12544" in res.stderr and "'longest_edge': 3136" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()  # refused before a run directory exists


def test_teacher_sees_the_student_s_image_inputs(cache_dir: Path) -> None:
    """The pixel values of a row (made by the student's processor) are what the teacher's
    own processor makes of the image, and the teacher's targets depend on them."""
    from roll_core.backends.train.base import TrainBackendSpec
    from roll_core.data import collate_sft
    from roll_core.data.sft import encode_prompt_response_images
    from roll_core.data.vision import read_images
    from roll_core.models import load_tokenizer, materialize_builtin
    from roll_core.models.vision import load_processor
    from roll_core.workers.teacher import Teacher

    student = str(materialize_builtin("tiny-qwen2.5-vl", cache_dir))
    teacher_path = str(materialize_builtin("small-qwen2.5-vl", cache_dir))
    row = json.loads((SHAPES / "train.jsonl").read_text().splitlines()[0])
    images = read_images(row["images"], base_dir=SHAPES, column="images")
    proc = load_processor(student, load_tokenizer(student))
    example = encode_prompt_response_images(proc, row["prompt"], row["response"], images)
    own = load_processor(teacher_path, load_tokenizer(teacher_path)).process_images(images)
    assert example["vision"].equal(own)

    batch = collate_sft([example], pad_id=proc.tokenizer.pad_token_id)
    spec = TrainBackendSpec(model_path=teacher_path, device="cpu", num_threads=1)
    teacher = Teacher(spec=spec, rank=0, world_size=1)
    teacher.setup()
    kw = {"temperature": 1.0, "top_k": None, "vocab_size": len(proc.tokenizer)}
    with_images = teacher.targets(batch, **kw)["teacher_logprobs"]
    batch.non_tensors["pixel_values"] = [torch.zeros_like(batch.non_tensors["pixel_values"][0])]
    blank = teacher.targets(batch, **kw)["teacher_logprobs"]
    assert (with_images - blank).abs().max() > 1e-4
