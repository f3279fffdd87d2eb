"""Hugging Face model directories: read safetensors lazily, write safetensors shards + index.

Reading opens every ``*.safetensors`` file with ``safetensors.safe_open`` (memory-mapped) and
returns one tensor at a time. Writing collects tensors until a shard reaches
``max_shard_bytes``, writes it with ``safetensors.torch.save_file`` and frees it: memory holds
at most one shard. Names follow ``save_pretrained``: ``model.safetensors`` for one shard,
``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json`` for several.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from roll_core.errors import ModelError, UsageError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: Files copied by ``--tokenizer`` (those that exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


#: safetensors header dtype codes of floating-point tensors.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class HFReader:
    """Tensors of a local Hugging Face model directory, read one at a time."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise ModelError(
                f"{directory} has no config.json, so it is not a Hugging Face model directory.",
                hint="Pass a directory written by save_pretrained (config.json + *.safetensors).",
            )
        try:
            self.config: dict[str, Any] = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelError(
                f"{config_file} is not valid JSON: {e}.", hint="Fix or re-save it."
            ) from e
        index = directory / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [str(directory / f) for f in files if not (directory / f).is_file()]
            if missing:
                raise ModelError(
                    f"{len(missing)} shard file(s) named in {index} are missing: "
                    + ", ".join(missing),
                    hint="Download or copy the complete model directory.",
                )
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                bins = sorted(p.name for p in directory.glob("*.bin"))
                raise ModelError(
                    f"{directory} has no *.safetensors weights"
                    + (f" (it has {', '.join(bins)})" if bins else "")
                    + ".",
                    hint="Re-save the model with save_pretrained(..., safe_serialization=True).",
                )
            weight_map = {}
        self._files = files
        self._handles: dict[str, Any] = {}
        self._weight_map = weight_map

    def _handle(self, f: str) -> Any:
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(str(self.dir / f), framework="pt")
            except Exception as e:  # safetensors raises its own error type for bad headers
                raise ModelError(
                    f"cannot read {self.dir / f}: {e}",
                    hint="The file is damaged or incomplete; download or copy it again.",
                ) from e
        return self._handles[f]

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file (from the index, else from the files' headers)."""
        if not self._weight_map:
            self._weight_map = {k: f for f in self._files for k in self._handle(f).keys()}  # noqa: SIM118
        return self._weight_map

    def has(self, name: str) -> bool:
        """Whether tensor ``name`` is stored."""
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name``."""
        f = self.weight_map.get(name)
        if f is None:
            raise ModelError(
                f"{self.dir} has no tensor {name}.",
                hint="The weights do not match config.json (another architecture or a damaged "
                "download).",
            )
        return self._handle(f).get_tensor(name)

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype of tensor ``name``, from the file header (the tensor is not read)."""
        f = self.weight_map.get(name)
        if f is None:
            return self.get(name).dtype  # raises the "no tensor" error
        code = self._handle(f).get_slice(name).get_dtype()
        return _SAFETENSORS_DTYPES.get(code) or self.get(name).dtype

    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point tensor (the model's dtype)."""
        for name in self.weight_map:
            t = self.get(name)
            if t.is_floating_point():
                return t.dtype
        return torch.float32


class HFWriter:
    """Writes safetensors shards of at most ``max_shard_bytes`` and the index."""

    def __init__(self, directory: Path, max_shard_bytes: int) -> None:
        self.dir = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue ``tensor``; write the current shard first if it would grow past the limit."""
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        n = len(self._shards)
        save_file(self._pending, str(self.dir / f"shard-{n:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, name the shards like ``save_pretrained`` and write the index."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        names = (
            [SINGLE_FILE]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        for i, name in enumerate(names):
            (self.dir / f"shard-{i:05d}.tmp").rename(self.dir / name)
        if n > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {t: names[i] for i, shard in enumerate(self._shards) for t in shard},
            }
            (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files of ``src`` (a directory) into ``dst``; return their names."""
    if not src.is_dir():
        raise UsageError(
            f"--tokenizer {src} is not a directory.",
            hint="Pass the directory that holds tokenizer.json / tokenizer_config.json.",
        )
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not any(n.startswith("tokenizer") or n in ("vocab.json",) for n in copied):
        present = ", ".join(sorted(p.name for p in src.iterdir())[:12]) or "nothing"
        raise UsageError(
            f"--tokenizer {src} has no tokenizer files (it has: {present}).",
            hint="Pass a directory written by tokenizer.save_pretrained.",
        )
    for name in copied:
        shutil.copy2(src / name, dst / name)
    return copied
