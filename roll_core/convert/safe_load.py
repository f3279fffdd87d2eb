"""Read Megatron's pickled files without running code from them and without Megatron.

Megatron checkpoints are pickles: ``model_optim_rng.pt`` (legacy layout), ``common.pt`` and the
``.metadata`` of ``torch_dist`` checkpoints. They reference classes a converter does not have
(Megatron's enums in ``args``, its ``MCoreMetadata``) and that ``torch.load(weights_only=True)``
refuses. A plain ``pickle.load`` would import and call whatever the file names.

:class:`_SafeUnpickler` allows only what rebuilds tensors, containers, ``argparse.Namespace``,
numpy arrays (Megatron stores numpy RNG states) and the dataclasses and enums of
``torch.distributed.checkpoint``; every other class becomes an inert :class:`Opaque` record
that keeps its name and arguments (so ``args.attention_backend`` reads as
``Opaque(megatron.core.transformer.enums.AttnBackend, 5)``). Functions outside the list are
refused, so loading a file never runs its code.

``torch.load`` does not check the CRC-32 that ``torch.save``'s zip container stores for every
member, so garbage inside a tensor's bytes loads as wrong weights. :func:`check_zip_crcs`
checks them first (for ``model_optim_rng.pt``, ``common.pt`` and each tensor item of a
``*.distcp`` file, which ``torch.distributed.checkpoint`` also writes with ``torch.save``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import io
import pickle
import types
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from roll_core.errors import CheckpointError

_TORCH_SAFE_NAMES = {"Size", "device", "dtype", "finfo", "iinfo", "layout", "memory_format"}
_NUMPY_SAFE = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
}
_BUILTINS_SAFE = {"set", "frozenset", "slice", "complex", "bytearray", "range", "tuple", "list"}
_PLAIN = {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("argparse", "Namespace"),
    ("types", "SimpleNamespace"),
    ("torch.serialization", "_get_layout"),
    ("torch.nn.parameter", "Parameter"),
    # how pickle protocol 2 stores bytes (numpy RNG states in roll's megatron checkpoints):
    # str -> bytes, nothing else (torch's weights_only loader allows it too)
    ("_codecs", "encode"),
}


class Opaque:
    """A stand-in for an object of a class the converter does not load (kept for display)."""

    _opaque_name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        inner = ", ".join(repr(a) for a in self.args)
        return f"Opaque({self._opaque_name}{', ' + inner if inner else ''})"


def _opaque(module: str, name: str) -> type[Opaque]:
    return type(name, (Opaque,), {"_opaque_name": f"{module}.{name}", "__module__": module})


def _dcp_class(module: str, name: str) -> Any:
    """A dataclass or enum of torch.distributed.checkpoint (the pickled DCP metadata)."""
    obj = getattr(importlib.import_module(module), name, None)
    if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
        return obj
    return None


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name.startswith("_rebuild_"):
            return getattr(importlib.import_module(module), name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if (
                name in _TORCH_SAFE_NAMES
                or isinstance(obj, torch.dtype)
                or name.endswith("Storage")
            ):
                return obj
        if module == "torch.storage" and name in {"UntypedStorage", "TypedStorage"}:
            return getattr(torch.storage, name)
        if (module, name) in _NUMPY_SAFE or (module, name) in _PLAIN:
            return getattr(importlib.import_module(module), name)
        if module == "builtins" and name in _BUILTINS_SAFE:
            return getattr(__import__("builtins"), name)
        if module.startswith("torch.distributed.checkpoint"):
            cls = _dcp_class(module, name)
            if cls is not None:
                return cls
        if module.startswith(("torch", "builtins", "numpy", "os", "sys", "subprocess")):
            # a function of a library we have: never call it from a checkpoint
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return _opaque(module, name)


#: ``torch.load(pickle_module=...)`` wants a module with ``Unpickler`` and ``load``.
safe_pickle = types.SimpleNamespace(
    Unpickler=_SafeUnpickler,
    load=lambda f, **kw: _SafeUnpickler(f, **kw).load(),
    __name__="roll_safe_pickle",
)


def check_zip_crcs(source: Path | io.BytesIO, where: str) -> None:
    """Raise a CheckpointError naming ``where`` and the member when a member of the zip
    container ``source`` fails its CRC-32 check. Not a zip (a pre-1.6 ``torch.save``) or a zip
    whose directory cannot be read (truncated): nothing to check here, ``torch.load`` reports
    it."""
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError, ValueError):
        return
    with archive:
        for info in archive.infolist():
            try:
                with archive.open(info) as member:
                    while member.read(1 << 20):
                        pass
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as e:
                raise CheckpointError(
                    f"{where} is damaged: its member {info.filename!r} fails the zip "
                    f"container's check ({e}); converting it would give wrong weights.",
                    hint="The file was changed after it was saved (a bad copy or disk); copy "
                    "the checkpoint again from where it was saved.",
                ) from None


def load_torch_file(path: Path, *, mmap: bool = True) -> Any:
    """``torch.load`` of a Megatron file, memory-mapped, with the safe unpickler above; the
    zip container's CRCs are checked first (:func:`check_zip_crcs`)."""
    check_zip_crcs(path, str(path))
    try:
        return torch.load(
            path,
            map_location="cpu",
            mmap=mmap,
            weights_only=False,
            pickle_module=safe_pickle,  # type: ignore[arg-type]
        )
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot read {path}: {type(e).__name__}: {e}",
            hint="The file is damaged or not a PyTorch checkpoint; re-copy it from where it "
            "was saved.",
        ) from e


def load_pickle(path: Path) -> Any:
    """A plain pickle (the ``.metadata`` of a torch_dist checkpoint), with the safe unpickler."""
    try:
        with open(path, "rb") as f:
            return _SafeUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, OSError, AttributeError, ValueError) as e:
        raise CheckpointError(
            f"cannot read {path}: {type(e).__name__}: {e}",
            hint="The torch_dist metadata is damaged; re-copy the checkpoint directory.",
        ) from e


def namespace_to_dict(args: Any) -> dict[str, Any]:
    """Megatron's ``args`` (an ``argparse.Namespace`` or a dict) as a plain dict."""
    if isinstance(args, argparse.Namespace | types.SimpleNamespace):
        return dict(vars(args))
    if isinstance(args, dict):
        return dict(args)
    if isinstance(args, Opaque) and isinstance(args.state, dict):
        return dict(args.state)
    return {}
