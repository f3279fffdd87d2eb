"""The prompts of `roll train rlvr`: each usable row of the RL data as a :class:`Prompt`
(its ids as `data.chat_template` and `data.system_prompt` render them, and its images for a
vision-language model), and the endless, resumable :class:`PromptStream` the rollout pulls
them from."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from roll_core.data.chat import encode_chat_images, image_message, prompt_turns
from roll_core.data.loader import StatefulLoader
from roll_core.data.sft import encode_chat_prompt, encode_prompt
from roll_core.data.sources import load_rows, require_columns, require_field, row_value
from roll_core.data.vision import BadImageError, VisionInputs, image_rows
from roll_core.errors import ConfigError, DataError

if TYPE_CHECKING:
    from roll_core.config.rlvr import RLVRConfig
    from roll_core.config.schema import DatasetSource


@dataclass
class Prompt:
    """One dataset row ready for generation."""

    index: int
    prompt_ids: list[int]
    row: dict[str, Any]
    vision: VisionInputs | None = None
    """The row's images (vision-language models), made once when the data is loaded."""


class PromptTable(Sequence[Prompt]):
    """The usable prompts of a dataset, held compactly: every prompt's ids in one int32 array
    (4 bytes a token, where a list of Python ints costs 36) and each row left in the dataset's
    Arrow table (memory-mapped from the `datasets` cache), made into a :class:`Prompt` when
    one is read. 20,000 tiny-arith prompts held 19 MiB as Prompt objects, 0.6 MiB here."""

    def __init__(self, rows: Any, *, answer_key: str, image_key: str | None) -> None:
        # the datasets.Dataset the prompts come from; an image column stays out of the rows
        # (the decoded images are the prompts' `vision`), so reading a row decodes none
        self._rows = rows.remove_columns([image_key]) if image_key is not None else rows
        self._answer_key = answer_key
        self._ids = array("i")
        self._ends = array("q")  # prompt i's ids: _ids[_ends[i - 1] : _ends[i]]
        self._source = array("q")  # prompt i's row in `rows`
        self._vision: list[VisionInputs | None] | None = None

    def append(self, source_row: int, ids: Sequence[int], vision: VisionInputs | None) -> None:
        self._ids.extend(ids)
        self._ends.append(len(self._ids))
        self._source.append(source_row)
        if vision is not None and self._vision is None:
            self._vision = [None] * (len(self._source) - 1)
        if self._vision is not None:
            self._vision.append(vision)

    def __len__(self) -> int:
        return len(self._source)

    @overload
    def __getitem__(self, i: int) -> Prompt: ...
    @overload
    def __getitem__(self, i: slice) -> list[Prompt]: ...
    def __getitem__(self, i: int | slice) -> Prompt | list[Prompt]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"prompt {i} of {len(self)}")
        row = self._rows[int(self._source[i])]
        if self._answer_key != "answer":  # rewards read the reference from row["answer"]
            row = {**row, "answer": row_value(row, self._answer_key)}
        start = self._ends[i - 1] if i else 0
        vision = self._vision[i] if self._vision is not None else None
        return Prompt(i, self._ids[start : self._ends[i]].tolist(), row, vision)

    def __iter__(self) -> Iterator[Prompt]:
        return (self[i] for i in range(len(self)))


def load_prompts(
    cfg: RLVRConfig, tokenizer: Any, source: DatasetSource, key: str, processor: Any = None
) -> tuple[PromptTable, dict[str, int]]:
    """The usable prompts of `source` (`key`: its recipe key, named in errors) and the counts
    of rows read and dropped (empty, too long, unreadable image)."""
    d = cfg.data
    rows = load_rows(
        source.path, split=source.split, subset=source.subset, max_rows=source.max_rows, key=key
    )
    require_columns(rows, [d.prompt_key], what=f"the RL data ({key})")
    require_field(rows, d.answer_key, what=f"the RL data ({key})")
    images = image_rows(
        rows, column=d.image_key, processor=processor, data_path=source.path, model=cfg.model.path
    )
    if images is not None and d.chat_template == "none":
        raise ConfigError(
            f"{source.path} has images (column {d.image_key!r}), but data.chat_template is none: "
            "image placeholders are written by a chat template.",
            hint="Set data.chat_template: model (the default) or a template file.",
        )
    image_key = d.image_key if images is not None else None
    out = PromptTable(rows, answer_key=d.answer_key, image_key=image_key)
    stats = {"rows": 0, "dropped_too_long": 0, "dropped_empty": 0, "dropped_bad_image": 0}
    for index, row in enumerate(rows):
        stats["rows"] += 1
        prompt = _prompt_of(cfg, row, index, source.path)
        answer = row_value(row, d.answer_key)
        if prompt is None or answer in (None, ""):
            stats["dropped_empty"] += 1
            continue
        vision = None
        if images is not None:
            try:
                pictures = images.read(row.get(d.image_key))
            except BadImageError as err:
                stats["dropped_bad_image"] += 1
                images.warn(index, err)
                continue
            if isinstance(prompt, list):
                raise DataError(
                    f"Row {index} of {source.path} has images and a conversation prompt "
                    f"(column {d.prompt_key!r} is a list of turns); image rows take a text "
                    "prompt.",
                    hint="Give image rows their prompt as text (see docs/vlm.md).",
                )
            ids, vision = encode_image_prompt(images.processor, prompt, pictures, d.system_prompt)
        else:
            ids = encode_text_prompt(cfg, tokenizer, prompt)
        if len(ids) > d.max_prompt_length:
            stats["dropped_too_long"] += 1
            continue
        out.append(index, ids, vision)
    if not out:
        raise DataError(
            f"no usable rows in {source.path} ({stats['dropped_empty']} empty, "
            f"{stats['dropped_too_long']} longer than data.max_prompt_length={d.max_prompt_length}"
            f", {stats['dropped_bad_image']} with an unreadable image).",
            hint="Check data.prompt_key / data.answer_key / data.image_key, or raise "
            "data.max_prompt_length.",
        )
    return out, stats


def _prompt_of(
    cfg: RLVRConfig, row: dict[str, Any], index: int, path: str
) -> str | list[dict[str, Any]] | None:
    """A row's prompt: its text, its conversation (a list of chat turns), or None when blank.
    Another type, or a conversation with `data.chat_template: none`, is an error."""
    key = cfg.data.prompt_key
    value = row.get(key)
    turns = prompt_turns(value, row=index, column=key, source=path)
    if turns is None:
        if value is not None and not isinstance(value, str):
            raise DataError(
                f"Row {index} of column {key!r} in {path} is a {type(value).__name__}; an RL "
                "prompt is text or a list of chat turns [{role, content}, ...].",
                hint="Point data.prompt_key at the prompt column, or fix the row.",
            )
        return value if value and value.strip() else None
    if not any(t["content"].strip() for t in turns):
        return None
    if cfg.data.chat_template == "none":
        raise ConfigError(
            f"column {key!r} of {path} holds conversations (lists of chat turns), but "
            "data.chat_template is none (raw prompts): a conversation is rendered by a chat "
            "template.",
            hint="Set data.chat_template: model (the default) or the path of a template file.",
        )
    return turns


def encode_text_prompt(cfg: RLVRConfig, tokenizer: Any, prompt: Any) -> list[int]:
    """The ids of a text prompt or a conversation (list of turns), as `data.chat_template` and
    `data.system_prompt` render it."""
    d = cfg.data
    if isinstance(prompt, list):
        return encode_chat_prompt(tokenizer, _with_system(prompt, d.system_prompt))
    if d.chat_template == "none":
        return list(tokenizer(prompt)["input_ids"])  # raw prompt: the tokenizer's own specials
    return list(encode_prompt(tokenizer, prompt, system=d.system_prompt))


def _with_system(turns: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """`data.system_prompt` before a conversation that has no system turn of its own."""
    if system is None or any(t["role"] == "system" for t in turns):
        return turns
    return [{"role": "system", "content": system}, *turns]


def encode_image_prompt(
    processor: Any, text: str, images: list[Any], system: str | None
) -> tuple[list[int], VisionInputs | None]:
    """Ids and vision inputs of one image row: [system?, user: images then text] + header."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    messages.append(image_message(text, len(images)))
    return encode_chat_images(processor, messages, images, add_generation_prompt=True)


def prompts_note(stats: dict[str, int], train: int, evals: int) -> str:
    """The console line on the data a run trains on (rows used, dropped and why): ``stats``
    of :func:`load_prompts`, and the number of training and eval prompts kept."""
    bad_image = stats.get("dropped_bad_image")
    return (
        f"data: {stats['rows']} rows, {train} prompts used "
        f"({stats['dropped_too_long']} too long, {stats['dropped_empty']} empty"
        + (f", {bad_image} with an unreadable image" if bad_image else "")
        + f"); eval {evals} prompts"
    )


class PromptStream:
    """An endless, resumable stream of training prompts (one loader 'batch' = one prompt)."""

    def __init__(self, prompts: Sequence[Prompt], *, seed: int, shuffle: bool) -> None:
        self.prompts = prompts
        self.loader = StatefulLoader(len(prompts), 1, seed=seed, shuffle=shuffle)

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> Prompt:
        return self.prompts[next(self.loader)[0]]
