"""`roll generate`: look at what a model answers, one prompt or a chat.

::

    gen = Generator.load("my-run", GenerateSettings(max_new_tokens=32))
    gen.complete("What is 2 + 3?")            # one user turn, the model's reply
    chat = gen.chat(system="Be brief.")
    chat.say("What is 2 + 3?"); chat.say("And times 4?")   # the history is kept

Prompts are rendered with the model's chat template (one user turn, or the whole conversation
so far in chat mode) and answered by the same infer backends training generates with. Each
reply is seeded from ``seed`` and the turn number, so a scripted chat repeats exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_core.backends.infer import INFER_BACKENDS, Request, SamplingParams, make_infer_backend
from roll_core.data import encode_chat_prompt
from roll_core.errors import UsageError
from roll_core.evaluation.models import ResolvedModel, resolve_model_or_run
from roll_core.models import load_tokenizer, resolve_model_path


@dataclass(frozen=True)
class GenerateSettings:
    max_new_tokens: int | None = None
    """None: the run's eval/rollout budget, else 128."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    backend: str = "hf"
    system_prompt: str | None = None
    """None: the run's data.system_prompt (if any)."""


def check_generate_settings(s: GenerateSettings) -> None:
    """Raises UsageError for a bad budget, temperature, top-p or backend."""
    if s.max_new_tokens is not None and s.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {s.max_new_tokens}.")
    if s.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0: greedy), got {s.temperature:g}.")
    if not 0 < s.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {s.top_p:g}.")
    if s.backend not in INFER_BACKENDS:
        raise UsageError(
            f"--backend: unknown backend {s.backend!r}; valid: {', '.join(INFER_BACKENDS)}."
        )


class Generator:
    """A loaded model and tokenizer behind an infer backend."""

    def __init__(self, model: ResolvedModel, settings: GenerateSettings) -> None:
        check_generate_settings(settings)
        self.model = model
        self.settings = settings
        budget = model.setting("eval", "max_new_tokens") or model.setting(
            "rollout", "max_new_tokens"
        )
        self.max_new_tokens = settings.max_new_tokens or (
            budget if isinstance(budget, int) else 128
        )
        system = settings.system_prompt
        self.system_prompt = (
            system if system is not None else model.setting("data", "system_prompt")
        )
        self.tokenizer = load_tokenizer(model.path)
        path = resolve_model_path(model.path)
        kwargs: dict[str, Any] = {"model_path": path}
        if settings.backend == "vllm":
            kwargs |= {"dtype": "float32", "seed": settings.seed}
        self.backend = make_infer_backend(settings.backend, **kwargs)
        self._calls = 0

    @classmethod
    def load(
        cls, model_or_run: str, settings: GenerateSettings, *, runs_dir: str | Path = "runs"
    ) -> Generator:
        check_generate_settings(settings)
        return cls(resolve_model_or_run(model_or_run, runs_dir=runs_dir), settings)

    def reply(self, messages: list[dict[str, str]]) -> str:
        """The model's next assistant turn after `messages` (rendered with the chat template)."""
        ids = encode_chat_prompt(self.tokenizer, messages)
        params = SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.settings.temperature,
            top_p=self.settings.top_p,
        )
        request = Request(
            request_id=self._calls, prompt_ids=ids, seed=self.settings.seed + self._calls
        )
        self._calls += 1
        (completion,) = self.backend.generate([request], params)
        return str(self.tokenizer.decode(completion.response_ids, skip_special_tokens=True))

    def complete(self, prompt: str) -> str:
        """The reply to one user turn (after the system prompt, if any)."""
        return self.chat().say(prompt)

    def chat(self) -> Chat:
        return Chat(self, system=self.system_prompt)

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()


@dataclass
class Chat:
    """A conversation: every `say` sends the whole history and appends the reply."""

    generator: Generator
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every turn (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def say(self, text: str) -> str:
        self.messages.append({"role": "user", "content": text})
        answer = self.generator.reply(self.messages)
        self.messages.append({"role": "assistant", "content": answer})
        return answer
