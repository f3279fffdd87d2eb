"""`roll distill`: a student learns a frozen teacher's next-token distributions.

The driver loop::

    for step in run.steps(max_steps):                     # resumes after the saved step
        batch = collate(next(loader))                     # prompts + responses (SFT formats)
        batch += teacher.targets(batch)                   # p_teacher at response positions
        metrics = actor_train.train_step(batch, "distill")  # divergence(p_teacher, q_student)
        if eval due:  metrics |= evaluate()               # held-out KL, agreement, exact match
        tracking.log(step, metrics)
        if save due:  checkpoint(step)
    export final student (merged when LoRA)

The teacher and the student may differ in size; they must share one tokenizer, which
`prepare` checks before a run directory exists. Logits past the tokenizer's size (embedding
padding, which differs between model sizes) are dropped on both sides.

Image rows (vision-language models, ``data.image_key``): each row's images are processed once,
by the student's processor, and the same ``pixel_values`` / ``image_grid_thw`` go to both
models, so teacher and student see identical inputs. That is only right when the teacher would
have made the same inputs itself: `prepare` checks that both are vision-language models whose
image processors and image tokens agree (:func:`check_same_processor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from roll_core.config.preference import DistillConfig
from roll_core.data import Batch, collate_sft
from roll_core.engine import Cluster
from roll_core.engine.model_sizes import model_shape
from roll_core.engine.plan import Plan
from roll_core.errors import ConfigError, ModelError
from roll_core.models import (
    load_tokenizer,
    model_summary,
    resolve_model_path,
    resolve_tokenizer_path,
)
from roll_core.models.loading import is_vision_model
from roll_core.models.lora import check_lora_targets_from_config
from roll_core.models.vision import load_processor
from roll_core.pipelines import roles
from roll_core.pipelines.common import DriverLoop, RolePlan
from roll_core.pipelines.sft import SFTData
from roll_core.pipelines.sft import prepare_data as prepare_sft_data
from roll_core.pipelines.supervised import (
    ResolvedModel,
    Session,
    exact_match,
    resolve_model,
    run_supervised,
    sum_metrics,
)

FULL_VOCAB_LIMIT_BYTES = 4 << 30
"""Teacher targets of one step above this size need `distill.top_k` (checked in `prepare`)."""


def plan(cfg: DistillConfig, _plan: Plan) -> list[RolePlan]:
    """Roles, workers and devices this recipe asks for (no model is loaded)."""
    lora, k = cfg.actor_train.lora, cfg.distill.top_k
    batch = cfg.trainer.global_batch_size(cfg.actor_train.world_size)
    student = f"student {cfg.model.path}; global batch {batch}"
    teacher = f"frozen {cfg.teacher.path}{_teacher_size(cfg)}; {cfg.distill.loss}, "
    return [
        roles.actor_train_row(cfg, student + (f"; LoRA rank {lora.rank}" if lora else "")),
        roles.frozen_row(
            cfg, "teacher", "Teacher", teacher + (f"top-{k} + tail" if k else "full vocabulary")
        ),
    ]


def _teacher_size(cfg: DistillConfig) -> str:
    """`` (8.29B params, 0.68B vision tower; weights 15.4 GiB in bfloat16)``: the frozen
    teacher's memory on the student's device, when its shape is known offline."""
    shape = model_shape(cfg.teacher.path)
    if shape is None:
        return ""

    def count(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"

    vision = f", {count(shape.vision_params)} vision tower" if shape.vision_params else ""
    size = shape.params * {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.teacher.dtype]
    shown = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    return f" ({count(shape.params)} params{vision}; weights {shown} in {cfg.teacher.dtype})"


#: Image-processor settings that decide the pixel values and the image-token count of an image.
PROCESSOR_KEYS = (
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "min_pixels",
    "max_pixels",
    "size",
    "do_resize",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)


def check_same_processor(
    student: Any, teacher: Any, *, student_name: str, teacher_name: str
) -> None:
    """A ModelError when two VisionProcessors would turn one image into different inputs."""
    differ = [
        f"{key} {_setting(student.image_processor, key)} vs "
        f"{_setting(teacher.image_processor, key)}"
        for key in PROCESSOR_KEYS
        if getattr(student.image_processor, key, None)
        != getattr(teacher.image_processor, key, None)
    ]
    if student.image_token != teacher.image_token:
        differ.append(f"image token {student.image_token!r} vs {teacher.image_token!r}")
    if differ:
        raise ModelError(
            f"the student ({student_name}) and the teacher ({teacher_name}) process images "
            f"differently (student vs teacher): {'; '.join(differ)}. Both models are given the "
            "same pixel values, made once per image, so their image processors must agree.",
            hint="Pick a teacher and a student of one vision-language family (e.g. "
            "Qwen2.5-VL-7B-Instruct and Qwen2.5-VL-3B-Instruct), or make the two "
            "preprocessor_config.json files agree.",
        )


def _setting(processor: Any, key: str) -> str:
    """An image-processor setting for an error message (a size dict without its unset keys)."""
    value = getattr(processor, key, None)
    if hasattr(value, "__dataclass_fields__"):
        value = {k: v for k, v in vars(value).items() if v is not None}
    return repr(value)


def check_teacher_sees_images(
    cfg: DistillConfig, student: Any, teacher_path: str, tok: Any
) -> None:
    """Image rows: the teacher must be a vision-language model processing images like the
    student (``student``: the student's VisionProcessor)."""
    if not is_vision_model(teacher_path):
        raise ModelError(
            f"the data has images (column data.image_key={cfg.data.image_key}), but "
            f"teacher.path={cfg.teacher.path} is a text-only model: it would not see them.",
            hint="Use a vision-language teacher of the student's family (e.g. "
            "Qwen2.5-VL-7B-Instruct for a Qwen2.5-VL-3B student), or text data.",
        )
    check_same_processor(
        student,
        load_processor(teacher_path, tok),
        student_name=cfg.model.path,
        teacher_name=cfg.teacher.path,
    )


def check_same_vocabulary(student_tok: Any, teacher_tok: Any, *, student: str, teacher: str) -> int:
    """The shared vocabulary size; a ModelError when the two tokenizers differ."""
    s, t = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s != t:
        differ = sorted(tok for tok in s.keys() | t.keys() if s.get(tok) != t.get(tok))
        shown = ", ".join(repr(x) for x in differ[:3])
        raise ModelError(
            f"the teacher ({teacher}) and the student ({student}) have different tokenizers: "
            f"{len(t)} and {len(s)} tokens, {len(differ)} of them with different ids (e.g. "
            f"{shown}). Distillation compares the two next-token distributions token by "
            "token, so both models need one vocabulary.",
            hint="Pick a teacher and a student of one model family (e.g. Qwen2.5-7B-Instruct "
            "and Qwen2.5-1.5B-Instruct), or point teacher.tokenizer / model.tokenizer at the "
            "right tokenizer.",
        )
    return len(student_tok)


@dataclass
class DistillSetup(ResolvedModel):
    """What `prepare` checks and builds before a run directory exists."""

    data: SFTData
    teacher_path: str
    teacher_tokenizer: str
    vocab_size: int


def prepare(cfg: DistillConfig) -> DistillSetup:
    """Resolve both models, check the shared vocabulary, LoRA targets and the memory of the
    teacher's targets, and tokenise the data: bad input fails before a run directory exists."""
    model = resolve_model(cfg)
    teacher_path = resolve_model_path(cfg.teacher.path)
    teacher_tok = (
        resolve_tokenizer_path(cfg.teacher.tokenizer) if cfg.teacher.tokenizer else teacher_path
    )
    teacher_tokenizer = load_tokenizer(teacher_tok)
    vocab = check_same_vocabulary(
        model.tokenizer,
        teacher_tokenizer,
        student=cfg.model.path,
        teacher=cfg.teacher.path,
    )
    for who, path in (("model", cfg.model.path), ("teacher", cfg.teacher.path)):
        rows = model_summary(path).get("vocab_size")
        if rows is not None and rows < vocab:
            raise ModelError(
                f"{who}.path {path} has {rows} output rows but its tokenizer has {vocab} tokens.",
                hint=f"Point {who}.tokenizer at the tokenizer the model was trained with.",
            )
    if cfg.distill.top_k is None:
        rows_per_step = cfg.trainer.global_batch_size(cfg.actor_train.world_size)
        size = rows_per_step * cfg.data.max_length * vocab * 4
        if size > FULL_VOCAB_LIMIT_BYTES:
            raise ConfigError(
                f"distill.top_k is not set: the teacher's full distributions for one step "
                f"({rows_per_step} rows x {cfg.data.max_length} tokens x {vocab} vocabulary) "
                f"take {size / 2**30:.0f} GiB.",
                hint="Set distill.top_k (e.g. 64): the teacher then sends its 64 most likely "
                "tokens and the rest of its mass per position.",
            )
    if cfg.actor_train.lora is not None:
        check_lora_targets_from_config(model.model_path, cfg.actor_train.lora.target_modules)
    # `data` and `eval` are the SFT sections: the SFT pipeline's data preparation applies.
    data = prepare_sft_data(cast(Any, cfg), model.tokenizer, model.processor)
    if any(e.get("vision") is not None for e in data.train + data.eval):  # image rows
        check_teacher_sees_images(cfg, model.processor, teacher_path, teacher_tokenizer)
    return DistillSetup(
        **vars(model),
        data=data,
        teacher_path=teacher_path,
        teacher_tokenizer=teacher_tok,
        vocab_size=vocab,
    )


def summarise(sums: dict[str, float], prefix: str) -> dict[str, float]:
    """Per-token means of the `distill` objective's metric sums, named `prefix/...`."""
    n = max(1.0, sums["distill/tokens"])
    return {
        f"{prefix}/loss": sums["distill/loss_sum"] / n,
        f"{prefix}/kl": sums["distill/kl_sum"] / n,
        f"{prefix}/agreement": sums["distill/agree_sum"] / n,
    }


def run(cfg: DistillConfig, setup: DistillSetup, loop: DriverLoop) -> dict[str, float]:
    """Train `cfg` inside the run `loop` manages (fresh or resumed); returns final metrics."""
    data, tokenizer = setup.data, setup.tokenizer
    loop.console_note(
        f"data: {data.stats['rows']} rows, {len(data.train)} used "
        f"({data.stats.get('dropped_too_long', 0)} longer than data.max_length dropped); "
        f"eval {len(data.eval)} rows"
    )
    d = cfg.distill
    pad_id = tokenizer.pad_token_id
    objective = dict(
        objective="distill",
        loss_type=d.loss,
        skew_alpha=d.skew_alpha,
        jsd_beta=d.jsd_beta,
        vocab_size=setup.vocab_size,
    )

    def start(executor: Any, actor: Cluster, info: dict[str, Any]) -> Session:
        teacher = roles.build_teacher(
            cfg,
            executor,
            plan=loop.plan,
            model_path=setup.teacher_path,
            tokenizer_path=setup.teacher_tokenizer,
        )
        with loop.phase("loading model (teacher)"):
            tinfo = teacher.setup()[0]
        loop.console_note(
            f"actor_train (student): {info['params']:,} parameters ({info['trainable']:,} "
            f"trained) on {info['device']}; teacher: {tinfo['params']:,} parameters"
        )
        teacher_em: list[float] = []  # the teacher never changes: its exact match is computed once

        def with_targets(batch: Batch, temperature: float) -> Batch:
            targets = teacher.targets(
                batch,
                temperature=temperature,
                top_k=d.top_k,
                vocab_size=setup.vocab_size,
            )
            for key, value in targets.items():
                batch[key] = value
            return batch

        def batch(indices: list[int]) -> Batch:
            batch = collate_sft([data.train[i] for i in indices], pad_id=pad_id)
            batch.meta["loss_tokens"] = int(batch.tensors["loss_mask"][:, 1:].sum())
            return with_targets(batch, d.temperature)

        def evaluate(step: int) -> dict[str, float]:
            return _evaluate(
                cfg, data, actor, teacher, tokenizer, with_targets, objective, teacher_em
            )

        return Session(
            batch=batch,
            summarise=lambda out, _: summarise(out, "train"),
            objective={**objective, "temperature": d.temperature},
            evaluate=evaluate if data.eval else None,
            eval_at_start=True,
        )

    return run_supervised(
        cfg,
        loop,
        setup,
        train_size=len(data.train),
        unit="examples",
        micro_batch_size=cfg.trainer.micro_batch_size,
        start=start,
    )


def _evaluate(
    cfg: DistillConfig,
    data: SFTData,
    actor: Cluster,
    teacher: Cluster,
    tokenizer: Any,
    with_targets: Any,
    objective: dict[str, Any],
    teacher_em: list[float],
) -> dict[str, float]:
    """Held-out divergence, KL and agreement at temperature 1, and exact match of both models."""
    sums: dict[str, float] = {}
    bs = cfg.eval.batch_size
    for i in range(0, len(data.eval), bs):
        batch = collate_sft(data.eval[i : i + bs], pad_id=tokenizer.pad_token_id)
        batch.meta["loss_tokens"] = 1  # metrics are sums; the loss value itself is unused
        batch = with_targets(batch, 1.0)
        sums = sum_metrics([sums, actor.evaluate(batch, temperature=1.0, **objective)])
    metrics = summarise(sums, "eval")
    if cfg.eval.exact_match and data.eval_prompts:
        metrics["eval/exact_match"] = exact_match(actor, data, tokenizer, cfg.eval)
        if not teacher_em:
            teacher_em.append(exact_match(teacher, data, tokenizer, cfg.eval))
        metrics["eval/teacher_exact_match"] = teacher_em[0]
    return metrics
