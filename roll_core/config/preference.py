"""Recipe schemas of `roll dpo` (preference optimisation) and `roll distill` (knowledge
distillation from a teacher). They reuse the sections of roll_core/config/schema.py; LoRA is
`actor_train.lora` there."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from roll_core.config.schema import (
    DatasetSource,
    ModelConfig,
    SFTDataConfig,
    Strict,
    SupervisedConfig,
)


class PreferenceDataConfig(Strict):
    """Pairwise preference data: a prompt, a chosen and a rejected response per row."""

    train: DatasetSource = Field(description="Training pairs.")
    eval: DatasetSource | None = Field(default=None, description="Held-out pairs for `eval`.")
    format: Literal["prompt_response", "messages"] = Field(
        default="prompt_response",
        description="`prompt_response`: text columns prompt, chosen, rejected; `messages`: "
        "chosen and rejected are chat conversations ending with the compared assistant turn "
        "(a prompt column holding messages is put before both; a text one is ignored).",
    )
    prompt_key: str = Field(default="prompt", description="Column holding the prompt.")
    chosen_key: str = Field(default="chosen", description="Column holding the preferred response.")
    rejected_key: str = Field(
        default="rejected", description="Column holding the dispreferred response."
    )
    max_length: int = Field(
        default=1024,
        ge=8,
        description="Longest tokenised prompt + response. Pairs with a longer side are dropped "
        "and counted, never truncated.",
    )
    shuffle: bool = Field(default=True, description="Shuffle every epoch (seeded by `seed`).")


class DPOLossConfig(Strict):
    """The preference objective (see docs/dpo.md for the formulas and papers)."""

    loss: Literal["sigmoid", "ipo", "cdpo"] = Field(
        default="sigmoid",
        description="`sigmoid`: DPO; `ipo`: IPO (squared loss, robust to deterministic "
        "preferences); `cdpo`: conservative DPO (labels assumed flipped with probability "
        "`label_smoothing`).",
    )
    beta: float = Field(
        default=0.1,
        gt=0,
        description="Strength of the implicit KL constraint to the reference policy: larger "
        "stays closer to the starting model.",
    )
    label_smoothing: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="`cdpo` only: the assumed probability that a pair's labels are flipped.",
    )
    sft_weight: float = Field(
        default=0.0,
        ge=0,
        description="Add this multiple of the chosen response's token-mean NLL to each pair's "
        "loss (RPO). DPO alone can lower the chosen likelihood while widening the margin; this "
        "term holds it up. 0: off.",
    )

    @model_validator(mode="after")
    def _smoothing_only_for_cdpo(self) -> DPOLossConfig:
        if self.loss == "cdpo" and self.label_smoothing == 0:
            raise ValueError(
                "cdpo with label_smoothing 0 is the sigmoid loss: set dpo.label_smoothing "
                "(e.g. 0.1) or use dpo.loss=sigmoid"
            )
        if self.loss != "cdpo" and self.label_smoothing > 0:
            raise ValueError(
                f"dpo.label_smoothing applies to dpo.loss=cdpo only (loss is {self.loss})"
            )
        return self


class DPOConfig(SupervisedConfig):
    """`roll dpo`: direct preference optimisation (DPO, IPO, cDPO) on chosen/rejected pairs.

    `trainer.micro_batch_size` counts pairs (two sequences each). The reference policy is the
    starting model: a frozen copy computes the reference log-probs of the pairs the run uses once
    before the first step (or, under `actor_train.lora`, the policy itself with its adapters
    disabled).
    """

    pipeline: Literal["dpo"] = Field(
        default="dpo", description="Which pipeline this recipe is for."
    )
    data: PreferenceDataConfig = Field(description="Preference pairs.")
    dpo: DPOLossConfig = Field(default_factory=DPOLossConfig, description="The DPO objective.")


class DistillLossConfig(Strict):
    """The distillation objective (see docs/distill.md for the formulas and papers)."""

    loss: Literal["forward_kl", "reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl"] = Field(
        default="forward_kl",
        description="Divergence between the teacher's (p) and the student's (q) next-token "
        "distributions: `forward_kl` KL(p||q), `reverse_kl` KL(q||p), `jsd` generalised "
        "Jensen-Shannon, `skew_forward_kl` / `skew_reverse_kl` (DistiLLM).",
    )
    temperature: float = Field(
        default=1.0,
        gt=0,
        description="Both distributions are softmax(logits / temperature); the loss is scaled "
        "by temperature^2.",
    )
    top_k: int | None = Field(
        default=None,
        ge=1,
        description="Keep the teacher's k most likely tokens plus one bucket for the rest of its "
        "mass (bounds memory: k + 1 numbers per token instead of the vocabulary). None: full.",
    )
    skew_alpha: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        description="Skew KLs: the mixture weight alpha of the skewed distribution.",
    )
    jsd_beta: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="`jsd`: the weight beta of the teacher in the mixture (0.5: symmetric JS).",
    )


class DistillConfig(SupervisedConfig):
    """`roll distill`: train a student to match a frozen teacher's next-token distributions on
    a dataset's prompts and responses (SFT data formats).

    Teacher and student may differ in size but must share one tokenizer (vocabulary). Eval
    reports the student's held-out KL to the teacher and, with `eval.exact_match`, the exact
    match of both models' greedy answers.
    """

    pipeline: Literal["distill"] = Field(
        default="distill", description="Which pipeline this recipe is for."
    )
    teacher: ModelConfig = Field(
        description="The teacher: frozen, on the same device as the student. "
        "`teacher.gradient_checkpointing` must stay false (no backward pass)."
    )
    data: SFTDataConfig = Field(description="Prompts and responses the student learns on.")
    distill: DistillLossConfig = Field(
        default_factory=DistillLossConfig, description="The distillation objective."
    )

    @model_validator(mode="after")
    def _teacher_is_frozen(self) -> DistillConfig:
        if self.teacher.gradient_checkpointing:
            raise ValueError(
                "teacher.gradient_checkpointing is set, but the frozen teacher runs no backward "
                "pass, so it would have no effect: remove it (model.gradient_checkpointing "
                "applies to the student)"
            )
        return self
