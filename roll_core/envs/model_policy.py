"""A language model as an env policy, through transformers' ``generate`` (for ``roll debug-env``).

The conversation is the env's system prompt, then the observations as user messages and the
model's responses as assistant messages, rendered by the model's own chat template. When the
conversation no longer fits the model's context (minus ``max_new_tokens``), the oldest turns are
dropped (the system prompt and the current observation always stay). Sampling is seeded from
the episode seed and the turn number, so a seed gives the same responses on every run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from roll_core.envs.base import observation_tool_results
from roll_core.errors import ModelError

if TYPE_CHECKING:
    from roll_core.envs.base import TextEnv


class ModelPolicy:
    """Answers observations with a causal LM (any local HF model, hub id or ``builtin:NAME``)."""

    name = "model"

    def __init__(
        self,
        model_path: str,
        *,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        device: str = "cpu",
    ) -> None:
        from roll_core.models import load_causal_lm, load_tokenizer

        self.model_path = model_path
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.tokenizer = load_tokenizer(model_path)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ModelError(
                f"the tokenizer of '{model_path}' has no chat template, so a conversation "
                "with the env cannot be rendered.",
                hint="Use a chat (instruct) model, or a built-in model such as builtin:tiny-qwen3.",
            )
        self.model = load_causal_lm(model_path, device=device)
        self.model.eval()
        self.device = device
        self.context = _context_length(self.model, self.tokenizer)
        self.messages: list[dict[str, str]] = []
        self.tools: list[dict[str, Any]] | None = None
        self._seed = 0
        self._info: dict[str, Any] = {}

    def start(self, env: TextEnv, seed: int) -> None:
        if env.render_image() is not None:
            raise ModelError(
                f"--policy model plays text observations, but env {type(env).name or 'env'} "
                "shows pictures (obs_mode=image) that the model would not see.",
                hint="Play it with obs_mode=text, or with --policy random / human (the "
                "pictures are saved and printed as files).",
            )
        self.messages = (
            [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
        )
        self.tools = env.tools or None  # native tool calling: the template renders them
        if self.tools:
            from roll_core.data.chat import tool_support_problem  # data/: loaded lazily

            problem = tool_support_problem(self.tokenizer, self.tools)
            if problem:
                names = ", ".join(str(t["function"]["name"]) for t in self.tools)
                raise ModelError(
                    f"env {type(env).name or 'env'} declares tools ({names}), but the chat "
                    f"template of {self.model_path} has no tool support: {problem}.",
                    hint="Use a model whose chat template renders tools (Qwen2.5-Instruct, "
                    "Qwen3, Hermes-style templates).",
                )
        self._seed = seed

    def act(self, observation: str) -> str | None:
        results = observation_tool_results(observation)
        if results:  # the answers to the model's tool calls: tool messages
            self.messages += [r.message() for r in results]
        else:
            self.messages.append({"role": "user", "content": str(observation)})
        prompt_ids, dropped = self._fit_prompt()
        turn = sum(m["role"] == "assistant" for m in self.messages)
        new, finish = self.generate_ids(prompt_ids, turn)
        if finish == "stop":
            new = new[: new.index(self.tokenizer.eos_token_id)]
        text = str(self.tokenizer.decode(new, skip_special_tokens=True))
        self.messages.append({"role": "assistant", "content": text})
        self._info = {
            "prompt_tokens": len(prompt_ids),
            "response_tokens": len(new),
            "finish_reason": finish,
            "dropped_turns": dropped,
        }
        return text

    def generate_ids(self, prompt_ids: list[int], turn: int) -> tuple[list[int], str]:
        """The model's response ids to ``prompt_ids`` (up to and with its eos) and the finish
        reason (``stop``: it ended with eos; ``length``), sampled from the episode seed and
        ``turn``."""
        ids = torch.tensor([prompt_ids], device=self.device)
        sampling = self.temperature > 0
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self._seed * 1_000_003 + turn)
            out = self.model.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=self.max_new_tokens,
                do_sample=sampling,
                temperature=self.temperature if sampling else None,
                top_p=None,
                top_k=None,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new = out[0, len(prompt_ids) :].tolist()
        eos = self.tokenizer.eos_token_id
        if eos in new:
            return new[: new.index(eos) + 1], "stop"
        return new, "length"

    def turn_info(self) -> dict[str, Any]:
        return dict(self._info)

    def _fit_prompt(self) -> tuple[list[int], int]:
        """Prompt ids of the conversation, dropping the oldest turns until it fits."""
        system = self.messages[:1] if self.messages and self.messages[0]["role"] == "system" else []
        turns = self.messages[len(system) :]
        budget = self.context - self.max_new_tokens
        dropped = 0
        while True:
            ids = self._encode(system + turns)
            if len(ids) <= budget:
                return ids, dropped
            if len(turns) <= 1:
                raise ModelError(
                    f"the system prompt and the current observation take {len(ids)} tokens, but "
                    f"{self.model_path} has a context of {self.context} tokens, of which "
                    f"{self.max_new_tokens} are kept for the response.",
                    hint="Lower --max-new-tokens, use a model with a longer context, or make "
                    "the env's observations shorter (e.g. a smaller room).",
                )
            first_reply = next(
                (i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns) - 1
            )
            turns = turns[first_reply + 1 :]  # the oldest observation (or tool results), its reply
            dropped += 1

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        from roll_core.data.chat import encode_chat  # data/ pulls in `datasets`: load lazily

        return encode_chat(
            self.tokenizer, messages, add_generation_prompt=True, fold_system=True, tools=self.tools
        )


def _context_length(model: Any, tokenizer: Any) -> int:
    limits = [getattr(model.config, "max_position_embeddings", None)]
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and tok_max < 10**7:  # transformers' "no limit" is ~1e30
        limits.append(tok_max)
    known = [int(v) for v in limits if isinstance(v, int) and v > 0]
    return min(known) if known else 2048
