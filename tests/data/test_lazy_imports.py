"""`roll_core.data` loads what a name needs, on first use (PEP 562)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import roll_core.data as data


def test_every_public_name_is_its_module_s_object() -> None:
    assert sorted(data.__all__) == sorted(data._LAZY)  # the two lists name the same things
    for name in data.__all__:
        module = importlib.import_module(data._LAZY[name])
        assert getattr(data, name) is getattr(module, name), name
    assert set(data.__all__) <= set(dir(data))


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        data.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("no AttributeError")


def test_batch_does_not_import_the_dataset_libraries() -> None:
    code = (
        "import sys; from roll_core.data import Batch; "
        "print(sorted(m for m in ('datasets', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = "import sys; from roll_core.data import load_rows; print('datasets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"  # the check above can fail
