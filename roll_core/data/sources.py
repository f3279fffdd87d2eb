"""Reading dataset rows: local json/jsonl/parquet/csv files and directories, or the HF hub.

``load_rows`` turns a recipe's ``path`` into a :class:`datasets.Dataset`. A path that exists
on disk, starts with ``/``, ``.`` or ``~``, or ends in a data-file extension is local; anything
else (``org/name``, ``name``) is a hub dataset name passed to :func:`datasets.load_dataset`.

A local file is read whole, whatever ``split`` says (the split name is only a label). In a
directory, files named after the split (``test.jsonl``, ``train-00000-of-00002.parquet``) are
the split; a directory whose files carry no split name is all ``train``. A folder written by
``datasets``' ``save_to_disk`` is read with ``load_from_disk``: a ``DatasetDict`` folder gives
the split named ``split``, a single ``Dataset`` folder is read whole (like a file). A directory
without data files of its own (a hub snapshot with one subfolder per configuration,
``main/train-*.parquet``) is an error naming the subfolders that hold data; ``subset=NAME``
picks the subfolder ``NAME`` of a local directory (the ``datasets`` convention for a hub
snapshot: ``<snapshot>/<config>/<split>-*.parquet``), and a NAME no subfolder has is an error
listing those that hold data. A single local file has no subsets: ``subset`` is ignored for it.

Every problem a user can fix (missing file, unknown extension, unparsable file, hub offline,
missing column) is a :class:`~roll_core.errors.DataError` with a one-paragraph message.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import datasets

from roll_core.errors import DataError

#: file extension -> ``datasets`` builder name
BUILDERS: dict[str, str] = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_SPLIT_WORDS = ("train", "test", "validation", "valid", "dev", "eval")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_FILE_LIKE = {*BUILDERS, ".txt", ".tsv", ".arrow", ".gz", ".zip", ".xlsx", ".yaml", ".yml"}


def load_rows(
    path: str,
    *,
    split: str = "train",
    subset: str | None = None,
    max_rows: int | None = None,
    key: str = "data.train.path",
) -> datasets.Dataset:
    """Load the rows of one dataset split.

    Args:
        path: a local file or directory, or a hub dataset name (``org/name``).
        split: the split to read (a label only for a single local file).
        subset: the hub configuration name (``main`` for ``openai/gsm8k``); for a local
            directory (a hub snapshot) the subfolder of that name; ignored for a local file.
        max_rows: keep at most this many rows (the first ones), or all when None.
        key: the recipe key that holds ``path``, named in error messages.
    """
    if max_rows is not None and max_rows < 1:
        raise DataError(f"max_rows must be at least 1, got {max_rows}.")
    if is_local_path(path):
        local = Path(path).expanduser()
        if subset is not None and local.is_dir():
            local = _subset_folder(local, subset, key=key)
        ds = _load_local(local, split=split, key=key)
    else:
        ds = _load_hub(path, split=split, subset=subset, key=key)
    if max_rows is not None and max_rows < len(ds):
        ds = ds.select(range(max_rows))
    return ds


def is_local_path(path: str) -> bool:
    """True when ``path`` names (or plainly means to name) something on the local disk."""
    if Path(path).expanduser().exists():
        return True
    if path.startswith(("/", ".", "~")) or "\\" in path:
        return True
    if Path(path).suffix.lower() in _FILE_LIKE:
        return True
    return not _HUB_NAME.match(path)


def require_columns(
    ds: datasets.Dataset, columns: Iterable[str], *, what: str, hint: str | None = None
) -> None:
    """Raise a DataError naming the missing and the available columns of ``ds``.

    ``what`` names the dataset in the message (``"the SFT training data"``).
    """
    available = list(ds.column_names)
    missing = [c for c in columns if c not in available]
    if missing:
        raise DataError(
            f"{what} has no column {_names(missing)}; its columns are {_names(available)}.",
            hint=hint
            or "Rename the columns in the data or point the recipe's *_key settings at "
            "existing columns.",
        )


def row_value(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]``; for a dotted key that is not a column (``reward_model.ground_truth``, the
    ground truth of verl's parquet layout) the nested field. None when absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def require_field(ds: datasets.Dataset, key: str, *, what: str, hint: str | None = None) -> None:
    """:func:`require_columns` for a key :func:`row_value` reads: a dotted key needs its first
    part as a column, and each further part as a field of that struct column where the
    column's features name its fields."""
    if key in ds.column_names or "." not in key:
        require_columns(ds, [key], what=what, hint=hint)
        return
    head, *parts = key.split(".")
    require_columns(ds, [head], what=what, hint=hint)
    feature: Any = ds.features[head]
    for depth, part in enumerate(parts):
        if not isinstance(feature, dict):
            return  # not a struct the schema describes (a JSON-like column): read per row
        if part not in feature:
            inside = ".".join([head, *parts[:depth]])
            raise DataError(
                f"{what} has no field {key!r}: column {inside!r} has the fields {_names(feature)}.",
                hint=hint
                or "Point the key at an existing field (a dotted key reads a field "
                "of a struct column, e.g. reward_model.ground_truth).",
            )
        feature = feature[part]


# -- local files ------------------------------------------------------------------------------


def _load_local(path: Path, *, split: str, key: str) -> datasets.Dataset:
    if not path.exists():
        shown = repr(str(path))
        if not path.is_absolute():
            shown += f" (resolved to {str(path.resolve())!r})"
        raise DataError(
            f"Dataset file {shown} does not exist.",
            hint=f"Set {key} to an existing json/jsonl/parquet/csv file or directory, or to a "
            "hub dataset name such as 'openai/gsm8k'.",
        )
    if path.is_dir() and _saved_kind(path) is not None:
        return _load_saved(path, split=split, key=key)
    if path.is_dir():
        builder, files = _directory_files(path, split=split, key=key)
    else:
        builder, files = _builder_for(path, key=key), [path]
    for f in files:
        check_text_rows(f, key=key)
    try:
        ds = datasets.load_dataset(
            builder, data_files={split: [str(f) for f in files]}, split=split
        )
    except Exception as err:  # any parse failure of user data
        raise DataError(
            f"Could not read {_names([str(f) for f in files])} as {builder}: {_reason(err)}",
            hint=f"Fix the file or set {key} to a different one.",
        ) from err
    if len(ds) == 0:
        raise DataError(
            f"{_names([str(f) for f in files])} has no rows.",
            hint=f"Point {key} at a file with data.",
        )
    return ds


MAX_ROW_BYTES = 8 * 1024 * 1024
"""The largest row (one line of a jsonl/csv file) read: 8 MiB of text is millions of tokens,
far past any model's context; a larger row is a broken file, refused before it is parsed."""


def check_text_rows(path: Path, *, key: str, limit: int = MAX_ROW_BYTES) -> None:
    """Refuse an empty file, or a line-based file (jsonl, json lines, csv) with a line longer
    than `limit`, by streaming it in 1 MiB chunks: no row is ever held whole. Parquet and
    single JSON documents (a `[...]` array) are not line-based and are not scanned."""
    if path.suffix.lower() == ".parquet":
        return
    line, current, seen_text = 1, 0, False
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            if not seen_text:
                stripped = chunk.lstrip()
                if stripped[:1] == b"[":
                    return  # one JSON document: datasets reads it whole anyway
                seen_text = bool(stripped)
            parts = chunk.split(b"\n")
            for i, part in enumerate(parts):
                current += len(part)
                if current > limit:
                    raise DataError(
                        f"{str(path)!r}: line {line} (one row) is over {limit // 2**20} MiB "
                        f"(at least {current:,} bytes); roll reads rows of at most "
                        f"{limit // 2**20} MiB.",
                        hint=f"Remove or split that row, or set {key} to another file.",
                    )
                if i < len(parts) - 1:
                    line += 1
                    current = 0
    if not seen_text:
        raise DataError(
            f"{str(path)!r} is empty: it has no rows.",
            hint=f"Point {key} at a file with data (a json/jsonl/parquet/csv file).",
        )


def _builder_for(path: Path, *, key: str) -> str:
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"Cannot read {str(path)!r}: unknown file extension {path.suffix!r}. "
            f"Supported extensions: {', '.join(BUILDERS)}.",
            hint=f"Convert the file to one of these formats or set {key} to another file.",
        )
    return builder


def _directory_files(directory: Path, *, split: str, key: str) -> tuple[str, list[Path]]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in BUILDERS)
    if not files:
        raise _no_files_error(directory, key=key)
    named = [p for p in files if _split_of(p) == split]
    if not named:
        splits = sorted({s for p in files if (s := _split_of(p))})
        if splits or split != "train":
            raise DataError(
                f"Directory {str(directory)!r} has no file for split {split!r}; "
                f"it has splits {_names(splits or ['train'])}.",
                hint="Set the split to one of those, or name a file after the split "
                f"(for example {split}.jsonl).",
            )
        named = files
    builders = sorted({BUILDERS[p.suffix.lower()] for p in named})
    if len(builders) > 1:
        raise DataError(
            f"Split {split!r} of {str(directory)!r} mixes file formats ({', '.join(builders)}).",
            hint=f"Keep one format per split, or set {key} to a single file.",
        )
    return builders[0], named


def _no_files_error(directory: Path, *, key: str) -> DataError:
    """No data file in ``directory``: name the subfolders that hold some (a hub snapshot keeps
    one folder per configuration, ``main/train-00000-of-00001.parquet``)."""
    message = f"Directory {str(directory)!r} holds no {'/'.join(BUILDERS)} files"
    holders = _data_subfolders(directory)
    if not holders:
        return DataError(
            message + ", and neither do its subfolders.",
            hint=f"Set {key} to a data file or a directory of data files.",
        )
    shown = [str(p.relative_to(directory)) for p in holders[:8]]
    more = f" and {len(holders) - 8} more" if len(holders) > 8 else ""
    hint = f"Set {key} to the subfolder you want, e.g. {key}={str(holders[0])}"
    if holders[0].parent == directory:  # one folder per configuration: `subset` picks it
        hint += f", or keep {key} and set {_subset_key(key)}={holders[0].name}"
    return DataError(
        f"{message} itself; its subfolder(s) {_names(shown)}{more} do (a hub snapshot keeps one "
        "folder per configuration or split).",
        hint=hint + ".",
    )


def _subset_key(key: str) -> str:
    """The recipe key of the ``subset`` next to the ``path`` named ``key``."""
    return key[: -len(".path")] + ".subset" if key.endswith(".path") else "subset"


def _subset_folder(directory: Path, subset: str, *, key: str) -> Path:
    """The subfolder ``subset`` of a local directory (a hub snapshot keeps one folder per
    configuration: ``<snapshot>/<subset>/<split>-*.parquet``)."""
    folder = directory / subset
    if subset not in ("", ".", "..") and folder.is_dir():
        return folder
    configs = sorted({p.relative_to(directory).parts[0] for p in _data_subfolders(directory)})
    where = f"{_subset_key(key)}={subset!r} names a subfolder of {str(directory)!r}"
    if not configs:
        raise DataError(
            f"{where} (a hub snapshot keeps one folder per configuration), but it has no "
            "subfolder with data files.",
            hint=f"Remove {_subset_key(key)} to read the directory itself, or set {key} to "
            "the snapshot that has the configuration.",
        )
    raise DataError(
        f"{where}, but there is none of that name; its subfolders with data are {_names(configs)}.",
        hint=f"Set {_subset_key(key)} to one of those (e.g. {_subset_key(key)}={configs[0]}).",
    )


def _data_subfolders(directory: Path, depth: int = 3) -> list[Path]:
    """Subfolders (up to ``depth`` levels down, hidden ones skipped) that hold data files or
    a ``save_to_disk`` dataset, in path order."""
    found: list[Path] = []
    if depth == 0:
        return found
    for sub in sorted(p for p in directory.iterdir() if p.is_dir()):
        if sub.name.startswith("."):
            continue
        has_files = any(p.is_file() and p.suffix.lower() in BUILDERS for p in sub.iterdir())
        if has_files or _saved_kind(sub) is not None:
            found.append(sub)
        else:
            found += _data_subfolders(sub, depth - 1)
    return found


def _saved_kind(directory: Path) -> str | None:
    """``"dict"`` / ``"dataset"`` for a folder written by ``save_to_disk``, else None."""
    if (directory / "dataset_dict.json").is_file():
        return "dict"
    if (directory / "state.json").is_file() and (directory / "dataset_info.json").is_file():
        return "dataset"
    return None


def _load_saved(directory: Path, *, split: str, key: str) -> datasets.Dataset:
    """A ``save_to_disk`` folder: the split ``split`` of a DatasetDict, or the whole Dataset."""
    try:
        loaded = datasets.load_from_disk(str(directory))
    except Exception as err:  # a damaged or incomplete save_to_disk folder
        raise DataError(
            f"Could not read {str(directory)!r} as a datasets save_to_disk folder: {_reason(err)}",
            hint=f"Save it again with save_to_disk, or set {key} to another dataset.",
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"{str(directory)!r} (a datasets DatasetDict folder) has no split {split!r}; "
                f"its splits are {_names(loaded)}.",
                hint=_split_hint(key, list(loaded)),
            )
        loaded = loaded[split]
    if not isinstance(loaded, datasets.Dataset) or len(loaded) == 0:
        raise DataError(
            f"{str(directory)!r} has no rows.", hint=f"Point {key} at a dataset with data."
        )
    return loaded


def _split_hint(key: str, splits: list[str]) -> str:
    if key.endswith(".path"):  # a recipe source: its `split` sits next to `path`
        return f"Set {key[: -len('.path')]}.split to one of those (e.g. {key[: -len('.path')]}.split={splits[0]})."
    return f"Point {key} at a dataset that has the split, or at one split's folder ({splits[0]}/)."


def _split_of(path: Path) -> str | None:
    """``train`` for train.jsonl / train-0000.parquet / train_part1.csv; None otherwise."""
    stem = path.name[: -len(path.suffix)]
    for word in _SPLIT_WORDS:
        if stem == word or stem.startswith((f"{word}-", f"{word}_", f"{word}.")):
            return word
    return None


# -- hub --------------------------------------------------------------------------------------


def _load_hub(name: str, *, split: str, subset: str | None, key: str) -> datasets.Dataset:
    not_local = (
        f"{name!r} is not a local file or directory (relative to {str(Path.cwd())!r}), "
        "so it was read as a hub dataset name"
    )
    try:
        return datasets.load_dataset(name, subset, split=split)
    except ConnectionError as err:
        raise DataError(
            f"{not_local}, but the Hugging Face hub is unreachable ({_reason(err)}).",
            hint=f"Go online, or download the data and set {key} to the local file.",
        ) from err
    except datasets.exceptions.DatasetNotFoundError as err:
        raise DataError(
            f"{not_local}, but the hub has no dataset {name!r} ({_reason(err)}).",
            hint=f"Check the spelling of {key}, or point it at a local file.",
        ) from err
    except Exception as err:  # unknown split or subset, gated dataset, broken files
        raise DataError(
            f"Could not load hub dataset {name!r} (subset {subset!r}, split {split!r}): "
            f"{_reason(err)}",
            hint=f"Check {key} and the split/subset settings next to it.",
        ) from err


# -- helpers ----------------------------------------------------------------------------------


def _reason(err: BaseException) -> str:
    """First line of the most telling error in the chain (skipping datasets' generic wrapper)."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    telling = next((e for e in chain if type(e).__name__ != "DatasetGenerationError"), err)
    lines = str(telling).strip().splitlines()
    return f"{type(telling).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _names(items: Iterable[str]) -> str:
    return ", ".join(repr(i) for i in items) or "(none)"
