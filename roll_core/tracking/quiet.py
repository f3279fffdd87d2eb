"""Keep third-party noise that is not the user's business out of a run's output.

`quiet_third_party` runs once when the CLI starts, before any heavy import. Every setting is
a default (``os.environ.setdefault``): a user who sets the variable keeps their value. With
``debug=True`` (``--debug`` / ``ROLL_DEBUG=1``) the messages are kept, on stderr.

* progress bars of datasets / transformers / the hub, and transformers' advisory warnings;
* DeepSpeed's ``Setting accelerator to CPU ...`` warning, which accelerate triggers on every
  CPU run by importing DeepSpeed, and which DeepSpeed prints on *stdout*;
* vLLM's INFO/WARNING logging (``VLLM_LOGGING_LEVEL=ERROR``);
* ``resource_tracker: There appear to be N leaked shared_memory objects`` at exit: Python's
  resource tracker process warns about shared memory that vLLM / torch workers leave to it
  (it cleans them up itself); the filter reaches that process through ``PYTHONWARNINGS``.
"""

from __future__ import annotations

import logging
import os
import sys

DEEPSPEED_LOGGER = "DeepSpeed"
ACCELERATOR_WARNING = "Setting accelerator to CPU"
LEAKED_SHM_FILTER = "ignore:resource_tracker:UserWarning"

_ENV_DEFAULTS = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "ERROR",
}


class _DropMessage(logging.Filter):
    """Drops records whose message starts with ``prefix`` (or, in debug, sends them to stderr)."""

    def __init__(self, prefix: str, *, debug: bool) -> None:
        super().__init__()
        self.prefix = prefix
        self.debug = debug

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.getMessage()).startswith(self.prefix):
            return True
        if self.debug:
            print(f"[debug] {record.name}: {record.getMessage()}", file=sys.stderr)
        return False


def quiet_third_party(*, debug: bool = False) -> None:
    """Set the environment and logging filters described in the module docstring."""
    for key, value in _ENV_DEFAULTS.items():
        if not (debug and key in ("VLLM_LOGGING_LEVEL", "TRANSFORMERS_VERBOSITY")):
            os.environ.setdefault(key, value)
    # The filter sits on the logger DeepSpeed will configure: its setLevel/addHandler keep it.
    ds_logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, _DropMessage) for f in ds_logger.filters):
        ds_logger.addFilter(_DropMessage(ACCELERATOR_WARNING, debug=debug))
    if not debug:
        current = os.environ.get("PYTHONWARNINGS", "")
        if LEAKED_SHM_FILTER not in current.split(","):
            os.environ["PYTHONWARNINGS"] = ",".join(x for x in (current, LEAKED_SHM_FILTER) if x)
