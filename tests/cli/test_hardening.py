"""Bad recipes and bad data found before anything starts (issue 19): a duplicate key or
section, more ranks than the executor can place, an empty data file, a huge row."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from roll_core.engine.resource_plan import available_cpus


def check(res, code: int, *needles: str) -> str:
    err = " ".join(res.stderr.split())
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout and "internal error" not in err
    for needle in needles:
        assert needle in err, res.stderr
    return err


def test_duplicate_key_names_both_lines(roll, tiny_recipe, tmp_path: Path) -> None:
    text = tiny_recipe().read_text()
    lines = text.splitlines()
    at = lines.index("trainer:")
    lines.insert(at + 1, "  max_steps: 99")  # line at+2; the recipe's own comes after it
    own = next(i for i, x in enumerate(lines) if x.strip().startswith("max_steps: 12")) + 1
    path = tmp_path / "dup.yaml"
    path.write_text("\n".join(lines) + "\n")
    check(
        roll("validate", str(path)),
        2,
        f"key trainer.max_steps is given twice (line {at + 2} and line {own})",
        "Delete the one you do not mean",
    )


def test_duplicate_section_names_both_lines(roll, tiny_recipe, tmp_path: Path) -> None:
    text = tiny_recipe().read_text()
    first = text.splitlines().index("trainer:") + 1
    second = len(text.splitlines()) + 1
    path = tmp_path / "dup.yaml"
    path.write_text(text + "trainer:\n  max_steps: 3\n")
    check(
        roll("sft", str(path)),
        2,
        f"section trainer is given twice (line {first} and line {second})",
        "Merge the two sections",
    )
    assert not (tmp_path / "runs").exists()  # refused before a run directory exists


def test_local_process_group_larger_than_the_machine_is_refused(roll, tiny_recipe) -> None:
    n = available_cpus() + 1
    recipe = tiny_recipe(actor_train={"backend": "fsdp2", "world_size": n, "device": "cpu"})
    check(roll("sft", str(recipe), "--dry-run"), 2, f"needs {n} CPU ranks (actor_train {n})")
    res = roll("sft", str(recipe))
    check(res, 2, f"this machine's {available_cpus()} CPUs", "Lower actor_train.world_size")
    assert not (recipe.parent / "runs").exists()


def test_ray_ranks_over_num_cpus_are_refused_not_a_hang(roll, tmp_path: Path) -> None:
    # 4 actor_train ranks + 1 actor_infer + 1 reference (GRPO's KL) = 6 actors of 1 CPU each,
    # on a local Ray cluster of 2 CPUs: before, the run waited for resources forever.
    root = Path(__file__).resolve().parents[2]
    recipe = yaml.safe_load((root / "recipes/tiny-arith-rlvr.yaml").read_text())
    recipe.update(runs_dir=str(tmp_path / "runs"), executor={"type": "ray", "num_cpus": 2})
    recipe["actor_train"] = {**recipe.get("actor_train", {}), "world_size": 4, "backend": "fsdp2"}
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(recipe))
    t = time.perf_counter()
    res = roll("train", "rlvr", str(path), f"data.train.path={root}/data/tiny-arith/train.jsonl")
    err = check(res, 2, "more than the ray executor can place on executor.num_cpus=2")
    assert "actor_train 4 + actor_infer 1" in err and "Raise executor.num_cpus" in err
    assert time.perf_counter() - t < 60  # refused up front (no Ray cluster was started)


def test_empty_data_file_is_a_data_error(roll, tiny_recipe, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    recipe = tiny_recipe(data={"train": {"path": str(empty)}, "max_length": 64}, eval={})
    err = check(roll("sft", str(recipe)), 2, "empty.jsonl' is empty: it has no rows")
    assert "StopIteration" not in err


def test_huge_row_is_refused_before_it_is_read_whole(roll, tiny_recipe, tmp_path: Path) -> None:
    data = tmp_path / "big.jsonl"
    with open(data, "w") as f:
        f.write(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
        f.write(json.dumps({"prompt": "x" * (50 * 2**20), "response": "2"}) + "\n")
    recipe = tiny_recipe(data={"train": {"path": str(data)}, "max_length": 64}, eval={})
    t = time.perf_counter()
    res = roll("sft", str(recipe))
    check(res, 2, "big.jsonl': line 2 (one row) is over 8 MiB", "Remove or split that row")
    assert time.perf_counter() - t < 60  # was 217 s and 10 GB before the clean rejection
