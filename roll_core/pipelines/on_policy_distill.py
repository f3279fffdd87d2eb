"""On-policy distillation on the RL loop (`algorithm.on_policy_distill` in `roll train rlvr`).

Not a pipeline of its own: the student samples through rlvr's rollout source, and this module
adds what the teachers need to the one RL loop (pipelines/rl_loop.py)::

    batch = source.to_batch(groups)                 # the student's own samples
    batch += old log-probs                          # always (the student's side of the KL)
    advantages_and_kl(batch)                        # the task reward's advantage, as in rlvr
    for each teacher (one per domain, or one for all):
        teacher_batch = its prompt (+ privileged context) + the sampled response ids
        lp = teacher.log_probs(teacher_batch)       # a frozen Reference worker
        teacher_log_probs[rows] = lp moved to the student's response positions
    advantages = coef * (teacher - student) [+ reward_weight * task advantages]
    mode full: the teachers' next-token distributions at the same positions go into the batch
               instead, and the `rl` objective adds coef * their divergence to the loss

A teacher is a frozen one-rank Reference worker on actor_train's rank-0 device (as the KL
reference, roles.py), built by `build_rl_roles`; it holds no state a checkpoint must keep,
so a resumed run rebuilds it from its path. Here: the recipe checks `roll validate` runs
(tokenizers, domains, privileged columns), the teachers' prompts, the teacher batch and the
advantage hook.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from roll_core.algorithms.on_policy_distill import on_policy_distill_advantages
from roll_core.config.on_policy_distill import DistillTeacherConfig, OnPolicyDistillConfig
from roll_core.config.rlvr import RLVRConfig
from roll_core.data import Batch, is_local_path, load_rows, row_value
from roll_core.engine import Cluster
from roll_core.errors import ConfigError, DataError, ModelError
from roll_core.models import load_tokenizer, resolve_tokenizer_path
from roll_core.models.builtin import BUILTIN_PREFIX
from roll_core.pipelines.common import RolePlan
from roll_core.pipelines.rl_iteration import RLState, advantages_and_kl

KEY = "algorithm.on_policy_distill"


def _where(role: str) -> str:
    return f"{KEY}." + ("teacher" if role == "teacher" else f"teachers.{role[len('teacher_') :]}")


# ---- recipe checks (roll validate, before a run directory exists) -------------------------


def check_recipe(cfg: RLVRConfig, *, load: bool = False) -> None:
    """The teachers against the recipe: per-domain names are reward domains, each teacher's
    tokenizer is the student's, privileged columns exist in the (local) data. `load`: also
    load tokenizers whose files are not there yet (`prepare`); without it such a teacher (a
    model a previous run will export) is left to `prepare`."""
    opd: OnPolicyDistillConfig | None = cfg.algorithm.on_policy_distill
    if opd is None:
        return
    domains = list(cfg.reward.domains)
    for domain in opd.teachers:
        if domain not in domains:
            close = difflib.get_close_matches(domain, domains, n=1)
            raise ConfigError(
                f"{KEY}.teachers.{domain}: no reward domain is called {domain!r} (the domains "
                f"are {', '.join(domains)}); a per-domain teacher scores the rows of one domain."
                + (f" Did you mean {close[0]!r}?" if close else ""),
                hint="Name the teacher after a key of `reward.domains`, or use `teacher:` for "
                "every domain.",
            )
    if opd.teacher is None:
        missing = [d for d in domains if d not in opd.teachers]
        if missing:
            raise ConfigError(
                f"{KEY}: the reward domain {missing[0]!r} has no teacher (teachers are given "
                f"for {', '.join(opd.teachers)} and there is no default `teacher:`).",
                hint=f"Add `teachers: {{{missing[0]}: {{path: MODEL}}}}` or a default "
                "`teacher: {path: MODEL}`.",
            )
    _check_pure(cfg, opd)
    for role, teacher in opd.named_teachers().items():
        _check_tokenizer(cfg, role, teacher, load=load)
    _check_context_columns(cfg, opd)


def _check_pure(cfg: RLVRConfig, opd: OnPolicyDistillConfig) -> None:
    """Pure distillation (reward_weight 0) drops the task advantage: what only enters through
    it (KL in the reward, a critic's values) would silently do nothing."""
    algo = cfg.algorithm
    if opd.reward_weight > 0:
        return
    if algo.kl.coef > 0 and algo.kl.use_as == "reward":
        raise ConfigError(
            f"{KEY}.reward_weight is 0 (pure distillation), so the task reward's advantage is "
            "not used, and algorithm.kl (use_as: reward) enters the advantage only through it: "
            "the KL penalty would do nothing.",
            hint="Set algorithm.kl.use_as: loss, or algorithm.kl.coef: 0, or a reward_weight "
            "above 0.",
        )
    if algo.uses_critic:
        raise ConfigError(
            f"{KEY}.reward_weight is 0 (pure distillation) and algorithm.adv_estimator is gae: "
            "the critic's values only enter the task advantage, which is not used.",
            hint="Use a critic-free estimator (grpo) and remove `critic:`, or set reward_weight "
            "above 0.",
        )


def _check_tokenizer(
    cfg: RLVRConfig, role: str, teacher: DistillTeacherConfig, *, load: bool
) -> None:
    if teacher.path is None and teacher.tokenizer is None:
        return  # the student's own weights and tokenizer
    name = teacher.tokenizer or teacher.path
    assert name is not None
    local = is_local_path(name) and not name.startswith(BUILTIN_PREFIX)
    if not load and local and not Path(name).expanduser().exists():
        return  # e.g. the export of a run that has not run yet: checked by `prepare`
    try:
        t_tok = load_tokenizer(resolve_tokenizer_path(name))
        s_tok = load_tokenizer(resolve_tokenizer_path(cfg.model.tokenizer or cfg.model.path))
    except (ModelError, OSError):
        if load:
            raise
        return  # a missing student model is reported by its own check
    check_same_tokenizer(
        s_tok, t_tok, student=cfg.model.tokenizer or cfg.model.path, teacher=name, key=_where(role)
    )


def check_same_tokenizer(student_tok: Any, teacher_tok: Any, *, student: str, teacher: str,
                         key: str) -> None:  # fmt: skip
    """A ConfigError naming the first token id whose token differs between the two
    tokenizers (the teacher scores the student's token ids, so they must mean the same)."""
    s = {i: tok for tok, i in student_tok.get_vocab().items()}
    t = {i: tok for tok, i in teacher_tok.get_vocab().items()}
    if s == t:
        return
    differ = [i for i in range(max(max(s), max(t)) + 1) if s.get(i) != t.get(i)]
    first = differ[0]
    raise ConfigError(
        f"{key}: the teacher's tokenizer ({teacher}, {len(t)} tokens) differs from the "
        f"student's ({student}, {len(s)} tokens): token id {first} is {_shown(t, first)} for "
        f"the teacher and {_shown(s, first)} for the student (the first of {len(differ)} ids that "
        "differ). The teacher scores the student's sampled token ids, so both need one "
        "vocabulary.",
        hint="Pick a teacher of the student's model family (e.g. Qwen2.5-7B-Instruct for a "
        "Qwen2.5-1.5B student), or point the teacher's `tokenizer:` / model.tokenizer at the "
        "tokenizer the models were trained with.",
    )


def _shown(vocab: dict[int, str], i: int) -> str:
    return repr(vocab[i]) if i in vocab else "absent"


def _check_context_columns(cfg: RLVRConfig, opd: OnPolicyDistillConfig) -> None:
    """A privileged column the local training data does not have: a ConfigError with the
    columns it has (hub data and paths not there yet are checked row by row at loading)."""
    keys = {r: t.context_key for r, t in opd.named_teachers().items() if t.context_key}
    source = cfg.data.train
    if not keys or not is_local_path(source.path) or not Path(source.path).expanduser().exists():
        return
    rows = load_rows(source.path, split=source.split, subset=source.subset, max_rows=1,
                     key="data.train.path")  # fmt: skip
    columns = list(rows.column_names)
    for role, key in keys.items():
        if key.split(".")[0] in columns:
            continue
        close = difflib.get_close_matches(key, columns, n=1)
        raise ConfigError(
            f"{_where(role)}.context_key: the training data {source.path} has no column "
            f"{key!r} (its columns: {', '.join(columns)}), so the teacher's privileged context "
            "would be empty." + (f" Did you mean {close[0]!r}?" if close else ""),
            hint="Point context_key at the column holding the privileged context (e.g. "
            "`answer` or a reference solution), or remove it.",
        )


def plan_rows(cfg: RLVRConfig, frozen_row: Callable[..., RolePlan]) -> list[RolePlan]:
    """The `--dry-run` rows of the teachers (frozen, on actor_train's rank-0 device)."""
    opd: OnPolicyDistillConfig | None = cfg.algorithm.on_policy_distill
    if opd is None:
        return []
    check_recipe(cfg)
    rows = []
    for role, t in opd.named_teachers().items():
        scope = "every domain" if role == "teacher" else f"domain {role[len('teacher_') :]}"
        what = t.path or f"{cfg.model.path} (the student's initial weights)"
        ctx = f"; privileged context {t.context_key!r}" if t.context_key else ""
        rows.append(frozen_row(cfg, role, "Reference", f"teacher of {scope}: {what}{ctx}"))
    return rows


# ---- teachers' prompts and batches ---------------------------------------------------------


def teacher_prompt_text(prompt: Any, context: Any, template: str) -> Any:
    """The teacher's prompt: `template` filled with the prompt and the context; a conversation
    (list of turns) gets it in its last user turn."""
    if not isinstance(prompt, list):
        return template.format(prompt=prompt, context=context)
    turns = [dict(t) for t in prompt]
    last = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=len(turns) - 1)
    turns[last]["content"] = template.format(prompt=turns[last]["content"], context=context)
    return turns


def teacher_prompts(
    opd: OnPolicyDistillConfig,
    prompts: Iterable[Any],
    *,
    prompt_key: str,
    encode: Callable[[Any], list[int]],
    source: str,
) -> dict[str, dict[int, list[int]]]:
    """For each teacher with privileged context: the ids of its prompt for each training prompt
    (by `Prompt.index`), rendered by `encode` (the student's chat template). A row without the
    column is a DataError naming it."""
    out: dict[str, dict[int, list[int]]] = {}
    prompts = list(prompts)
    for role, t in opd.named_teachers().items():
        if t.context_key is None:
            continue
        ids: dict[int, list[int]] = {}
        for p in prompts:
            if p.vision is not None:
                raise ConfigError(
                    f"{_where(role)}.context_key: the rows have images, and a teacher with "
                    "privileged context re-renders the prompt, which roll does for text "
                    "prompts only.",
                    hint="Remove context_key for image data (the teacher then sees the "
                    "student's inputs, images included).",
                )
            context = row_value(p.row, t.context_key)
            if context is None or context == "":
                raise DataError(
                    f"a training row of {source} (prompt {p.index}) has no value in column "
                    f"{t.context_key!r}, the privileged context of {_where(role)}.",
                    hint="Fill the column in every row, or point context_key at another one.",
                )
            text = teacher_prompt_text(p.row.get(prompt_key), context, t.context_template)
            ids[p.index] = encode(text)
        out[role] = ids
    return out


def teacher_of_rows(opd: OnPolicyDistillConfig, domains: list[str]) -> dict[str, list[int]]:
    """Which rows (by their reward domain) each teacher role scores."""
    rows: dict[str, list[int]] = {}
    for i, d in enumerate(domains):
        role = f"teacher_{d}" if d in opd.teachers else "teacher"
        if role == "teacher" and opd.teacher is None:
            raise DataError(
                f"a sample of domain {d!r} has no teacher in {KEY}.",
                hint=f"Add `teachers: {{{d}: {{path: MODEL}}}}` or a default `teacher:`.",
            )
        rows.setdefault(role, []).append(i)
    return rows


def teacher_batch(batch: Batch, rows: list[int], prompts: list[list[int] | None],
                  *, pad_id: int) -> tuple[Batch, torch.Tensor]:  # fmt: skip
    """The rows `rows` of a rollout batch (rollout/batch.py layout) with their prompts replaced
    by `prompts` (None: the row's own prompt) and the same response ids; and the new prompt
    lengths [len(rows)]. Image fields are carried along."""
    t = batch.tensors
    lengths = t["attention_mask"].sum(dim=1)
    seqs, plens = [], []
    for i, prompt in zip(rows, prompts, strict=True):
        r = int(t["response_lengths"][i])
        p = int(lengths[i]) - r
        head = prompt if prompt is not None else t["input_ids"][i, :p].tolist()
        seqs.append(head + t["input_ids"][i, p : p + r].tolist())
        plens.append(len(head))
    width = max(len(s) for s in seqs)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    resp = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for k, (seq, p) in enumerate(zip(seqs, plens, strict=True)):
        ids[k, : len(seq)] = torch.tensor(seq)
        attn[k, : len(seq)] = 1
        resp[k, p - 1 : len(seq) - 1] = 1.0
    vision: dict[str, list[Any]] = {
        k: [batch.non_tensors[k][i] for i in rows]
        for k in ("pixel_values", "image_grid_thw")
        if k in batch.non_tensors
    }
    tensors = {"input_ids": ids, "attention_mask": attn, "response_mask": resp}
    return Batch(tensors=tensors, non_tensors=vision, meta={}), torch.tensor(plens)


def to_student_positions(
    log_probs: torch.Tensor, teacher_prompt_lengths: torch.Tensor, batch: Batch, rows: list[int]
) -> torch.Tensor:
    """Teacher log-probs [len(rows), Tt-1, ...] (trailing dims: a distribution per position)
    moved to the rows' response positions in the student's batch; [len(rows), T-1, ...], 0
    elsewhere."""
    t = batch.tensors
    width = t["input_ids"].shape[1] - 1
    out = torch.zeros((len(rows), width, *log_probs.shape[2:]), dtype=log_probs.dtype)
    lengths = t["attention_mask"].sum(dim=1)
    for k, i in enumerate(rows):
        r = int(t["response_lengths"][i])
        p, tp = int(lengths[i]) - r, int(teacher_prompt_lengths[k])
        out[k, p - 1 : p - 1 + r] = log_probs[k, tp - 1 : tp - 1 + r]
    return out


Score = Callable[[Cluster, Batch], dict[str, torch.Tensor]]


def _scored(batch: Batch, teachers: dict[str, Cluster], opd: OnPolicyDistillConfig,
            contexts: dict[str, dict[int, list[int]]], *, pad_id: int,
            score: Score) -> dict[str, torch.Tensor]:  # fmt: skip
    """`score` of each teacher on its rows (its own prompts where it has privileged context),
    every field moved back to the batch's target positions [B, T-1, ...]."""
    out: dict[str, torch.Tensor] = {}
    for role, rows in teacher_of_rows(opd, list(batch.non_tensors["domain"])).items():
        ctx = contexts.get(role)
        if ctx is None and len(rows) == len(batch):  # its own prompts: the batch as it is
            return score(teachers[role], batch)
        index = batch.non_tensors["prompt_index"]
        prompts = [ctx[index[i]] if ctx is not None else None for i in rows]
        tb, plens = teacher_batch(batch, rows, prompts, pad_id=pad_id)
        for key, value in score(teachers[role], tb).items():
            moved = to_student_positions(value, plens, batch, rows)
            if key not in out:
                out[key] = torch.zeros((len(batch), *moved.shape[1:]), dtype=moved.dtype)
            out[key][rows] = moved
    return out


def teacher_log_probs(
    batch: Batch,
    teachers: dict[str, Cluster],
    opd: OnPolicyDistillConfig,
    contexts: dict[str, dict[int, list[int]]],
    *,
    pad_id: int,
    temperature: float,
) -> torch.Tensor:
    """Every teacher's log-probs of the sampled tokens of its rows, [B, T-1] in the batch's
    target space (0 outside the responses)."""

    def score(teacher: Cluster, b: Batch) -> dict[str, torch.Tensor]:
        return {"log_probs": teacher.log_probs(b, temperature=temperature)}

    out = _scored(batch, teachers, opd, contexts, pad_id=pad_id, score=score)["log_probs"]
    return out * batch.tensors["response_mask"]


def teacher_distributions(
    batch: Batch,
    teachers: dict[str, Cluster],
    opd: OnPolicyDistillConfig,
    contexts: dict[str, dict[int, list[int]]],
    *,
    pad_id: int,
    temperature: float,
    vocab_size: int,
) -> dict[str, torch.Tensor]:
    """`mode: full`: every teacher's next-token distributions at the response positions of its
    rows: ``teacher_dist_logprobs`` [B, T-1, K] and, with `top_k`, ``teacher_dist_ids``
    [B, T-1, k] (Reference.distributions; 0 outside the responses)."""

    def score(teacher: Cluster, b: Batch) -> dict[str, torch.Tensor]:
        got = teacher.distributions(b, temperature=temperature, top_k=opd.top_k,
                                    vocab_size=vocab_size)  # fmt: skip
        return {f"teacher_dist_{k}": v for k, v in got.items()}

    return _scored(batch, teachers, opd, contexts, pad_id=pad_id, score=score)


def per_teacher_metrics(batch: Batch, opd: OnPolicyDistillConfig) -> dict[str, float]:
    """`distill/ROLE/reverse_kl` per teacher (only with two or more): the masked token mean of
    student - teacher log-prob over the rows it scored."""
    owners = teacher_of_rows(opd, list(batch.non_tensors["domain"]))
    if len(opd.named_teachers()) < 2:
        return {}
    t = batch.tensors
    out = {}
    for role, rows in owners.items():
        mask = t["response_mask"][rows]
        diff = (t["old_log_probs"][rows] - t["teacher_log_probs"][rows]) * mask
        out[f"distill/{role}/reverse_kl"] = float(diff.sum() / mask.sum().clamp(min=1))
    return out


def distill_advantages(
    cfg: RLVRConfig,
    opd: OnPolicyDistillConfig,
    teachers: dict[str, Cluster],
    contexts: dict[str, dict[int, list[int]]],
    *,
    pad_id: int,
    vocab_size: int,
) -> Callable[[Batch, RLState], dict[str, float]]:
    """The RL loop's advantage hook (`RLHooks.advantages`): the task reward's advantages (rlvr's
    estimator, KL in the reward, overlong shaping), then the teachers' reverse-KL advantages
    mixed in (algorithms/on_policy_distill.py); `mode: full` also puts the teachers'
    distributions into the batch (the `rl` objective adds their reverse KL to the loss)."""
    algo = cfg.algorithm
    temperature = cfg.rollout.temperature or 1.0

    # pure distillation: the task advantage is not used, so a per-sample estimator stands in
    # for a group one (rollout.n may be 1); overlong filtering still masks its responses
    task = algo if opd.reward_weight > 0 else algo.model_copy(update={"adv_estimator": "reinforce"})

    def score(batch: Batch) -> None:
        """`teacher_log_probs` (and in mode full `teacher_dist_*`) into the batch. Mode full
        runs the teacher twice: its distributions cover the tokenizer's vocabulary only
        (renormalised there, as the student's are in the loss), while the sampled-token
        log-probs of the logged reverse KL are over the model's whole output layer, like the
        student's `old_log_probs`."""
        t = batch.tensors
        if opd.mode == "full":
            t.update(teacher_distributions(batch, teachers, opd, contexts, pad_id=pad_id,
                                           temperature=temperature, vocab_size=vocab_size))  # fmt: skip
            batch.meta["vocab_size"] = vocab_size  # the student's are cut to it in the loss
        t["teacher_log_probs"] = teacher_log_probs(batch, teachers, opd, contexts, pad_id=pad_id,
                                                   temperature=temperature)  # fmt: skip

    def advantages(batch: Batch, state: RLState) -> dict[str, float]:
        metrics = advantages_and_kl(batch, task, state, max_new_tokens=cfg.rollout.max_new_tokens)
        t = batch.tensors
        start = time.perf_counter()
        score(batch)
        metrics["time/teacher"] = time.perf_counter() - start
        mask = t["response_mask"]
        adv, distill = on_policy_distill_advantages(
            teacher_log_probs=t["teacher_log_probs"],
            student_log_probs=t["old_log_probs"],
            response_mask=mask,
            mode=opd.mode,
            coef=opd.coef,
            clip=opd.clip,
            task_advantages=t["advantages"],
            reward_weight=opd.reward_weight,
        )
        t["advantages"] = adv
        if opd.reward_weight == 0:  # no task advantage (n may be 1): no task returns either
            t["returns"] = adv
        metrics |= distill | per_teacher_metrics(batch, opd)
        metrics["actor/advantage_mean"] = float((adv * mask).sum() / mask.sum().clamp(min=1))
        metrics["actor/advantage_abs_max"] = float((adv.abs() * mask).max())
        return metrics

    return advantages
