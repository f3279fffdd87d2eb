"""Megatron-core <-> Hugging Face checkpoint conversion (``roll convert``).

No GPU and no Megatron install are needed: legacy checkpoints are read as memory-mapped
PyTorch files and ``torch_dist`` ones with ``torch.distributed.checkpoint`` in one process.
See docs/convert.md for the supported matrix.
"""

from roll_core.convert.archs import ARCHS, ArchSpec, ModelDims, supported
from roll_core.convert.convert import (
    DTYPES,
    FORMATS,
    ConvertResult,
    ProgressFn,
    hf_to_mcore,
    mcore_to_hf,
)
from roll_core.convert.megatron import open_checkpoint

__all__ = [
    "ARCHS",
    "DTYPES",
    "FORMATS",
    "ArchSpec",
    "ConvertResult",
    "ModelDims",
    "ProgressFn",
    "hf_to_mcore",
    "mcore_to_hf",
    "open_checkpoint",
    "supported",
]
