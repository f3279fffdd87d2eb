"""roll: reinforcement-learning post-training of LLMs, command line first."""

from __future__ import annotations

__version__ = "0.1.0"


def _hide_triton_without_gpu() -> None:
    """Make Triton look not installed in a process whose torch build has no GPU backend (the
    CPU wheel): no kernel of it can run there, yet `import transformers` imports it through
    `torch._dynamo` whenever it is installed (vLLM's xgrammar pulls it in), and its library
    then stays resident: 66 MiB of every CPU run's peak memory (docs/performance.md, "Where
    roll's memory went"). `sys.modules["triton"] = None` is what every importer reads as "not
    installed" (`import triton` raises ModuleNotFoundError, `importlib.util.find_spec` gives
    None). The build is read from torch's generated `version.py` without importing torch.
    `ROLL_ALLOW_TRITON=1` keeps Triton importable."""
    import importlib.util
    import os
    import sys
    from pathlib import Path

    if os.environ.get("ROLL_ALLOW_TRITON") == "1" or "triton" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.origin is None:
            return
        path = Path(spec.origin).with_name("version.py")
        version: dict[str, object] = {}
        exec(compile(path.read_text(), str(path), "exec"), version)  # torch's own constants
    except Exception:  # an unusual torch install: leave everything as it is
        return
    if not any(version.get(backend) for backend in ("cuda", "hip", "rocm", "xpu")):
        sys.modules["triton"] = None  # type: ignore[assignment]


_hide_triton_without_gpu()
