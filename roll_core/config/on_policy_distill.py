"""`algorithm.on_policy_distill`: a teacher scores the student's own samples (rlvr).

The section's keys and their checks that need no data or model; the checks against the data
and the tokenizers are in roll_core/pipelines/on_policy_distill.py (run by `roll validate`).
"""

from __future__ import annotations

import difflib
import string
from typing import Any, Literal

from pydantic import Field, model_validator

from roll_core.config.schema import Strict

DistillModeName = Literal["token", "sequence", "full"]
_MODES = ("token", "sequence", "full")


class DistillTeacherConfig(Strict):
    """One teacher: a model (or the student's initial weights) and what its prompt adds."""

    path: str | None = Field(
        default=None,
        description="The teacher model (`builtin:NAME`, a local HF directory or a hub id); "
        "null: the student's own initial weights (`model.path`), which only teach something "
        "when given privileged context (`context_key`). Its tokenizer must be the student's.",
    )
    tokenizer: str | None = Field(
        default=None, description="Tokenizer location when it differs from `path`."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="The teacher's weights (frozen, on actor_train's rank-0 device; counted "
        "in the GPU memory plan): bfloat16 halves a large teacher's memory.",
    )
    context_key: str | None = Field(
        default=None,
        description="Privileged context: a data column (e.g. `answer`, a reference solution) "
        "rendered into the teacher's prompt by `context_template`; the student never sees it. "
        "Every training row must have it. Null: the teacher sees the student's prompt.",
    )
    context_template: str = Field(
        default="{prompt}\n\nReference answer: {context}",
        description="The teacher's prompt text when `context_key` is set: `{prompt}` is the "
        "row's prompt, `{context}` the column's value (a conversation prompt: its last user "
        "turn). Rendered by the same chat template as the student's prompt.",
    )

    @model_validator(mode="after")
    def _template(self) -> DistillTeacherConfig:
        fields = {f for _, f, _, _ in string.Formatter().parse(self.context_template) if f}
        unknown = fields - {"prompt", "context"}
        if unknown:
            raise ValueError(
                f"context_template: unknown placeholder {{{sorted(unknown)[0]}}}; the "
                "template may use {prompt} and {context} (write {{ and }} for literal braces)"
            )
        if self.context_key is not None and "context" not in fields:
            raise ValueError(
                "context_template has no {context} placeholder, so the teacher would never see "
                f"the privileged column {self.context_key!r}: add {{context}} to the template"
            )
        return self


class OnPolicyDistillConfig(Strict):
    """On-policy distillation (`roll train rlvr`): the student samples through the normal
    rollout; a frozen teacher computes the log-probs of the sampled tokens; the per-token
    reverse-KL term `coef * (teacher - student log-prob)` is the advantage, plus
    `reward_weight` x the task reward's advantage. See docs/distill.md."""

    teacher: DistillTeacherConfig | None = Field(
        default=None,
        description="The teacher of every domain without one in `teachers` (null: every "
        "domain needs its own).",
    )
    teachers: dict[str, DistillTeacherConfig] = Field(
        default_factory=dict,
        description="Per-domain teachers, keyed by the row's domain (the `reward.domains` "
        "names): e.g. `{math: {path: ...}, code: {path: ...}}`.",
    )
    mode: DistillModeName = Field(
        default="token",
        description="`token`: each token's advantage is its own term (Thinking Machines); "
        "`sequence`: every token of a response gets the response's mean term; `full`: no "
        "advantage, the exact `divergence` of the whole next-token distributions at every "
        "sampled position is added to the loss (GKD, Agarwal et al.; `top_k` bounds the "
        "teacher's share).",
    )
    divergence: Literal["reverse_kl", "forward_kl", "jsd"] = Field(
        default="reverse_kl",
        description="`mode: full` only: the per-position divergence added to the loss: "
        "`reverse_kl` KL(student || teacher) (the sources' choice), `forward_kl` KL(teacher || "
        "student), `jsd` (GKD's generalised Jensen-Shannon, beta 0.5).",
    )
    top_k: int | None = Field(
        default=None,
        gt=0,
        description="`mode: full` only: the teacher sends its k most likely tokens plus one "
        "bucket for the rest of its mass at each position (as `roll distill`'s `top_k`); null: "
        "the whole vocabulary (fine for small vocabularies; [tokens, vocab] floats per step).",
    )
    coef: float = Field(
        default=1.0,
        gt=0,
        description="Weight of the reverse-KL advantage (`mode: full`: of the divergence loss).",
    )
    clip: float | None = Field(
        default=None,
        gt=0,
        description="Bound each token's reverse-KL term to [-clip, clip] (null: no bound).",
    )
    reward_weight: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the task reward's advantage (`algorithm.adv_estimator` on the "
        "rewards) added to the reverse-KL advantage; 0: pure distillation (rewards are still "
        "computed and logged, and `rollout.n` may be 1).",
    )

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        mode = data.get("mode") if isinstance(data, dict) else None
        if isinstance(mode, str) and mode not in _MODES:
            close = difflib.get_close_matches(mode, _MODES, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"mode: unknown value {mode!r}; {hint}valid: {', '.join(_MODES)}")
        return data

    @model_validator(mode="after")
    def _full_only(self) -> OnPolicyDistillConfig:
        if self.mode == "full" and self.clip is not None:
            raise ValueError(
                "clip bounds each token's sampled reverse-KL advantage, and mode full has no "
                "such advantage (it adds the exact per-position divergence to the loss): remove "
                "clip, or use mode token"
            )
        if self.mode != "full" and self.divergence != "reverse_kl":
            raise ValueError(
                f"divergence {self.divergence!r} needs the whole distributions of mode full; "
                f"mode {self.mode!r} estimates the reverse KL from the sampled token: set mode: "
                "full, or remove divergence"
            )
        if self.mode != "full" and self.top_k is not None:
            raise ValueError(
                f"top_k bounds the teacher's distributions of mode full, but mode is "
                f"{self.mode!r}, which reads only the teacher's log-prob of the sampled token: "
                "remove top_k, or set mode: full"
            )
        return self

    @model_validator(mode="after")
    def _some_teacher(self) -> OnPolicyDistillConfig:
        if self.teacher is None and not self.teachers:
            raise ValueError(
                "on_policy_distill has no teacher: set `teacher: {path: MODEL}` (or "
                "per-domain `teachers: {DOMAIN: {path: MODEL}}`)"
            )
        for name, t in [("teacher", self.teacher), *self.teachers.items()]:
            if t is not None and t.path is None and t.context_key is None:
                where = "teacher" if name == "teacher" else f"teachers.{name}"
                raise ValueError(
                    f"{where}: with no path the teacher is the student's own initial weights, "
                    "and without privileged context (context_key) it scores every token as "
                    "the student does: the advantage would stay 0. Set its path or its "
                    "context_key"
                )
        return self

    def teacher_for(self, domain: str) -> DistillTeacherConfig | None:
        """The teacher of `domain` (its own, else the default one)."""
        return self.teachers.get(domain, self.teacher)

    def named_teachers(self) -> dict[str, DistillTeacherConfig]:
        """Every teacher by its role name: `teacher` (the default), `teacher_DOMAIN`."""
        out = {"teacher": self.teacher} if self.teacher is not None else {}
        return out | {f"teacher_{d}": t for d, t in self.teachers.items()}
