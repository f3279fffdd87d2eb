"""Tests for roll_core/data/sources.py: local formats, directories, hub names, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from roll_core.data import is_local_path, load_rows, require_columns
from roll_core.errors import DataError

ROWS = [{"prompt": "p0", "response": "r0"}, {"prompt": "p1", "response": "r1"}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("ext", ["jsonl", "json", "csv", "parquet"])
def test_local_formats(tmp_path: Path, ext: str) -> None:
    path = tmp_path / f"rows.{ext}"
    if ext == "jsonl":
        write_jsonl(path, ROWS)
    elif ext == "json":
        path.write_text(json.dumps(ROWS))  # a JSON array, not JSON lines
    elif ext == "csv":
        path.write_text("prompt,response\np0,r0\np1,r1\n")
    else:
        datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    ds = load_rows(str(path))
    assert ds.column_names == ["prompt", "response"]
    assert ds.to_list() == ROWS
    assert load_rows(str(path), max_rows=1).to_list() == ROWS[:1]


def test_directory_splits(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "test.jsonl", ROWS[:1])
    (tmp_path / "README.md").write_text("ignored")
    assert len(load_rows(str(tmp_path))) == 2
    assert len(load_rows(str(tmp_path), split="test")) == 1
    with pytest.raises(DataError, match=r"no file for split 'validation'.*'test', 'train'"):
        load_rows(str(tmp_path), split="validation")


def test_directory_without_split_names_is_train(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "part-a.jsonl", ROWS)
    write_jsonl(tmp_path / "part-b.jsonl", ROWS[:1])
    assert len(load_rows(str(tmp_path))) == 3
    with pytest.raises(DataError, match="split 'test'"):
        load_rows(str(tmp_path), split="test")


def test_missing_file_names_path_and_key(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as err:
        load_rows(str(missing), key="data.eval.path")
    assert str(missing) in str(err.value) and "data.eval.path" in str(err.value)
    with pytest.raises(DataError, match="data.train.path"):
        load_rows("./also/missing")


def test_unknown_extension_lists_supported(tmp_path: Path) -> None:
    path = tmp_path / "rows.txt"
    path.write_text("hello\n")
    with pytest.raises(DataError, match=r"'\.txt'.*\.json, \.jsonl, \.parquet, \.csv"):
        load_rows(str(path))


def test_parse_error_gives_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": 2\n')
    with pytest.raises(DataError, match=r"Could not read .*bad\.jsonl.*JSON parse error") as err:
        load_rows(str(path))
    assert "DatasetGenerationError" not in str(err.value)


def test_hub_name_is_passed_through(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_load(path, name=None, *, split):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert len(load_rows("openai/gsm8k", split="test", subset="main", max_rows=1)) == 1
    assert calls == [("openai/gsm8k", "main", "test")]


def test_hub_offline_says_to_use_a_local_file(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/name' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"hub is unreachable.*\n.*local file"):
        load_rows("org/name")


def test_is_local_path(tmp_path: Path) -> None:
    assert is_local_path(str(tmp_path))
    assert is_local_path("./x") and is_local_path("~/x") and is_local_path("a/b/c.jsonl")
    assert is_local_path("train.parquet") and is_local_path("a/b/c")
    assert not is_local_path("openai/gsm8k") and not is_local_path("gsm8k")


def test_require_columns() -> None:
    ds = datasets.Dataset.from_list(ROWS)
    require_columns(ds, ["prompt"], what="The data")
    with pytest.raises(
        DataError, match=r"no column 'answer'; its columns are 'prompt', 'response'"
    ):
        require_columns(ds, ["prompt", "answer"], what="The data")


def test_check_text_rows_streams_long_lines_and_empty_files(tmp_path: Path) -> None:
    from roll_core.data.sources import check_text_rows

    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"a": 1}\n' * 3)
    check_text_rows(ok, key="k", limit=16)
    long = tmp_path / "long.jsonl"
    # line 2 is 9 + 1 + 20 = 30 bytes ('{"a": "' + 20 x + '"}'), over a 16-byte limit
    long.write_text('{"a": 1}\n{"a": "' + "x" * 20 + '"}\n')
    with pytest.raises(DataError, match="line 2 \\(one row\\)"):
        check_text_rows(long, key="k", limit=16)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n \n")
    with pytest.raises(DataError, match="is empty"):
        check_text_rows(blank, key="k")
    array = tmp_path / "arr.json"
    array.write_text("[" + '{"a": 1},' * 10 + '{"a": 1}]')  # one document: not line-scanned
    check_text_rows(array, key="k", limit=16)


# -- datasets save_to_disk folders and hub snapshots (issue 32, items 13 and 14) ---------------


def test_save_to_disk_dataset_dict_gives_the_named_split(tmp_path: Path) -> None:
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS), test=datasets.Dataset.from_list(ROWS[:1])
    ).save_to_disk(str(folder))
    assert load_rows(str(folder)).to_list() == ROWS  # not dataset_dict.json's 'splits'
    assert load_rows(str(folder), split="test").to_list() == ROWS[:1]
    assert load_rows(str(folder), max_rows=1).to_list() == ROWS[:1]
    with pytest.raises(DataError) as err:
        load_rows(str(folder), split="validation", key="data.eval.path")
    assert "has no split 'validation'; its splits are 'train', 'test'" in err.value.message
    assert "Set data.eval.split to one of those (e.g. data.eval.split=train)" in err.value.hint


def test_save_to_disk_single_dataset_is_read_whole(tmp_path: Path) -> None:
    folder = tmp_path / "one"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    assert load_rows(str(folder)).to_list() == ROWS  # not a JSON CastError on state.json
    assert load_rows(str(folder), split="test").to_list() == ROWS  # a label, like one file


def test_hub_snapshot_names_the_subfolders_with_data(tmp_path: Path) -> None:
    snapshot = tmp_path / "gsm8k"
    for config in ("main", "socratic"):
        (snapshot / config).mkdir(parents=True)
        datasets.Dataset.from_list(ROWS).to_parquet(
            str(snapshot / config / "train-00000-of-00001.parquet")
        )
    (snapshot / "README.md").write_text("card")
    (snapshot / ".cache").mkdir()
    with pytest.raises(DataError) as err:
        load_rows(str(snapshot))
    assert "holds no .json/.jsonl/.parquet/.csv files itself" in err.value.message
    assert "subfolder(s) 'main', 'socratic' do" in err.value.message
    assert f"data.train.path={snapshot / 'main'}" in (err.value.hint or "")
    assert "or keep data.train.path and set data.train.subset=main" in (err.value.hint or "")
    assert load_rows(str(snapshot / "main")).to_list() == ROWS  # the way out works


def _snapshot(root: Path) -> Path:
    """A hub snapshot the `datasets` way: <snapshot>/<config>/<split>-*.parquet|jsonl, each
    row naming its configuration and split, plus files and folders that are not data."""
    snapshot = root / "gsm8k"
    for config in ("main", "socratic"):
        (snapshot / config).mkdir(parents=True)
        for split in ("train", "test"):
            rows = [{"prompt": f"{config}-{split}-{i}", "response": str(i)} for i in range(3)]
            datasets.Dataset.from_list(rows).to_parquet(
                str(snapshot / config / f"{split}-00000-of-00001.parquet")
            )
    write_jsonl(snapshot / "socratic" / "validation.jsonl", [{"prompt": "v", "response": "0"}])
    (snapshot / "README.md").write_text("card")
    (snapshot / ".cache" / "huggingface").mkdir(parents=True)
    return snapshot


def test_subset_picks_the_configuration_folder_of_a_snapshot(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)
    main_test = load_rows(str(snapshot), split="test", subset="main")
    assert main_test["prompt"] == ["main-test-0", "main-test-1", "main-test-2"]
    socratic_train = load_rows(str(snapshot), subset="socratic", max_rows=2)
    assert socratic_train["prompt"] == ["socratic-train-0", "socratic-train-1"]
    validation = load_rows(str(snapshot), split="validation", subset="socratic")
    assert validation.to_list() == [{"prompt": "v", "response": "0"}]
    # A single file has no configurations: subset stays a hub-only setting there.
    one = snapshot / "main" / "test-00000-of-00001.parquet"
    assert load_rows(str(one), subset="main")["prompt"][0] == "main-test-0"


def test_unknown_subset_of_a_snapshot_lists_its_configurations(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)
    with pytest.raises(DataError) as err:
        load_rows(str(snapshot), subset="mian", key="data.eval.path")
    assert err.value.message == (
        f"data.eval.subset='mian' names a subfolder of {str(snapshot)!r}, but there is none of "
        "that name; its subfolders with data are 'main', 'socratic'."
    )
    assert err.value.hint == "Set data.eval.subset to one of those (e.g. data.eval.subset=main)."
    with pytest.raises(DataError, match="there is none of that name"):
        load_rows(str(snapshot), subset="README.md")  # a file, not a configuration folder
    flat = tmp_path / "flat"
    flat.mkdir()
    write_jsonl(flat / "train.jsonl", ROWS)
    with pytest.raises(DataError) as err:
        load_rows(str(flat), subset="main")
    assert "but it has no subfolder with data files" in err.value.message
    assert "Remove data.train.subset to read the directory itself" in (err.value.hint or "")


def test_directory_without_any_data_says_so(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="neither do its subfolders"):
        load_rows(str(tmp_path))


def test_row_value_reads_dotted_fields() -> None:
    from roll_core.data import row_value

    row = {"reward_model": {"ground_truth": "72", "style": "rule"}, "a.b": 1}
    assert row_value(row, "reward_model.ground_truth") == "72"
    assert row_value(row, "a.b") == 1  # a column whose name has a dot wins
    assert row_value(row, "reward_model.missing") is None
    assert row_value({"reward_model": None}, "reward_model.ground_truth") is None


def test_require_field_checks_struct_fields(tmp_path: Path) -> None:
    from roll_core.data import require_field

    path = tmp_path / "verl.parquet"
    datasets.Dataset.from_list(
        [{"prompt": "p", "reward_model": {"ground_truth": "5", "style": "rule"}}]
    ).to_parquet(str(path))
    ds = load_rows(str(path))
    require_field(ds, "reward_model.ground_truth", what="the RL data")
    require_field(ds, "prompt", what="the RL data")
    with pytest.raises(DataError) as err:
        require_field(ds, "reward_model.truth", what="the RL data")
    assert "has no field 'reward_model.truth'" in err.value.message
    assert "column 'reward_model' has the fields 'ground_truth', 'style'" in err.value.message
    with pytest.raises(DataError, match="has no column 'reward'"):
        require_field(ds, "reward.ground_truth", what="the RL data")
