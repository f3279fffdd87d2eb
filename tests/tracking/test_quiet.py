"""Third-party noise is dropped (or kept on stderr with --debug)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from roll_core.tracking import quiet


def _ds_logger_with_stdout_handler() -> logging.Logger:
    logger = logging.getLogger(quiet.DEEPSPEED_LOGGER)
    logger.filters.clear()
    return logger


def test_deepspeed_cpu_accelerator_warning_is_dropped(monkeypatch, capsys) -> None:
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    logger = _ds_logger_with_stdout_handler()
    quiet.quiet_third_party(debug=False)
    handler = logging.StreamHandler(sys.stdout)
    logger.addHandler(handler)  # what DeepSpeed's create_logger does after our filter is set
    try:
        logger.warning("Setting accelerator to CPU. If you have GPU ...")
        logger.warning("ZeRO stage 3 is enabled")  # other DeepSpeed messages still pass
    finally:
        logger.removeHandler(handler)
        logger.filters.clear()
    out = capsys.readouterr()
    assert "Setting accelerator" not in out.out + out.err
    assert "ZeRO stage 3 is enabled" in out.out
    assert quiet.LEAKED_SHM_FILTER in os.environ["PYTHONWARNINGS"].split(",")


def test_debug_keeps_the_warning_on_stderr(monkeypatch, capsys) -> None:
    logger = _ds_logger_with_stdout_handler()
    quiet.quiet_third_party(debug=True)
    try:
        logger.warning("Setting accelerator to CPU.")
    finally:
        logger.filters.clear()
    assert "[debug] DeepSpeed: Setting accelerator to CPU." in capsys.readouterr().err


def test_user_settings_win(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    quiet.quiet_third_party()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    logging.getLogger(quiet.DEEPSPEED_LOGGER).filters.clear()


LEAK = """
import multiprocessing as mp
from multiprocessing import shared_memory

def leak():
    shared_memory.SharedMemory(create=True, size=16).close()  # never unlinked

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=leak)
    p.start()
    p.join()
"""


def test_leaked_shared_memory_warning_is_silenced_in_the_resource_tracker(tmp_path) -> None:
    script = tmp_path / "leak.py"
    script.write_text(LEAK)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    loud = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert "leaked shared_memory" in loud.stderr  # the warning this filter is for
    env["PYTHONWARNINGS"] = quiet.LEAKED_SHM_FILTER
    calm = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert "leaked" not in calm.stderr
