"""Using a trained model: `roll eval` (accuracy, pass@k, length on a dataset with a reward) and
`roll generate` (one prompt or a chat). Models are named by run id, run / checkpoint / model
directory, builtin:NAME or hub id (:mod:`roll_core.evaluation.models`)."""

from roll_core.evaluation.evaluate import EvalResult, EvalSettings, check_settings, evaluate
from roll_core.evaluation.generate import Chat, GenerateSettings, Generator
from roll_core.evaluation.models import ResolvedModel, resolve_model_or_run
from roll_core.evaluation.passk import ks_for, mean_pass_at_k, pass_at_k

__all__ = [
    "Chat",
    "EvalResult",
    "EvalSettings",
    "GenerateSettings",
    "Generator",
    "ResolvedModel",
    "check_settings",
    "evaluate",
    "ks_for",
    "mean_pass_at_k",
    "pass_at_k",
    "resolve_model_or_run",
]
