"""A roll process on a CPU-only torch build does not load Triton (roll_core/__init__.py): no
Triton kernel runs without a GPU, and `import transformers` would otherwise keep its 66 MiB
library resident in every CPU run. Each case is a fresh interpreter, as a `roll` run is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

CPU_ONLY = not any(getattr(torch.version, b, None) for b in ("cuda", "hip", "rocm", "xpu"))
PROBE = """
import importlib.util, json, sys
import roll_core
from transformers import AutoModelForCausalLM  # imports torch._dynamo, which tries triton
try:
    import triton
    imported = True
except ModuleNotFoundError:
    imported = False
loaded = any(m.endswith("libtriton.so") for m in open("/proc/self/maps").read().split())
print(json.dumps({"find_spec": importlib.util.find_spec("triton") is not None,
                  "imported": imported, "library_mapped": loaded}))
"""


def probe(**env: str) -> dict[str, bool]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not CPU_ONLY, reason="a GPU build of torch keeps Triton")
def test_cpu_only_torch_hides_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLL_ALLOW_TRITON", raising=False)
    assert probe() == {"find_spec": False, "imported": False, "library_mapped": False}


@pytest.mark.skipif(not CPU_ONLY, reason="a GPU build of torch keeps Triton")
def test_roll_allow_triton_keeps_it_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLL_ALLOW_TRITON", raising=False)
    installed = subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('triton'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if installed == "None":
        pytest.skip("Triton is not installed here")
    seen = probe(ROLL_ALLOW_TRITON="1")
    assert seen["find_spec"] and seen["imported"] and seen["library_mapped"]
