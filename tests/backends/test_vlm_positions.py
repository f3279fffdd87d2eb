"""Vision-language rope positions: every roll forward of a Qwen2.5-VL model gives the image
tokens the model's 3-D (t, h, w) mrope positions (``mm_token_type_ids`` built from the ids,
roll_core/data/vision.py), in the trainer (padded and packed), the reference worker and the
hf sampler (fixed batch and the continuous-batching engine), so the sampler's behaviour
log-probs are the trainer's."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from roll_core.backends.infer import Request, SamplingParams
from roll_core.backends.infer.hf import HFInferBackend
from roll_core.backends.train.base import OptimConfig, TrainBackendSpec
from roll_core.backends.train.packing import rope_module
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.data import Batch
from roll_core.data.vision import VisionInputs, token_type_ids, vision_fields, vision_model_inputs
from roll_core.models.loading import resolve_model_path

# (width, height) of each row's images; tiny-qwen2.5-vl: 14-pixel patches merged 2x2, so a
# 56x56 image is a (1, 4, 4) patch grid = 2x2 = 4 image tokens, 84x56 is (1, 4, 6) = 2x3 = 6
SIZES: list[list[tuple[int, int]]] = [[(56, 56)], [(84, 56), (56, 56)], [], [(56, 112)]]


@pytest.fixture(scope="module")
def vl() -> tuple[str, object]:
    from roll_core.models.vision import load_processor

    path = resolve_model_path("builtin:tiny-qwen2.5-vl")
    return path, load_processor(path)


def _prompts(proc: object) -> list[tuple[list[int], VisionInputs | None]]:
    from PIL import Image

    from roll_core.data.chat import encode_chat_images, image_message

    out = []
    for i, sizes in enumerate(SIZES):
        imgs = [Image.new("RGB", s, (40 * i, 255 - 30 * k, 90)) for k, s in enumerate(sizes)]
        ids, vision = encode_chat_images(
            proc, [image_message("count" + "!" * i, len(imgs))], imgs, add_generation_prompt=True
        )
        out.append((ids, vision if imgs else None))
    return out


def _batch(rows: list[list[int]], visions: list[VisionInputs | None], pad: int) -> Batch:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    return Batch(
        tensors={"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone()},
        non_tensors=vision_fields(visions),
        meta={"loss_tokens": float(attn[:, 1:].sum())},
    )


def _trainer(path: str, packing: bool) -> TorchTrainBackend:
    return TorchTrainBackend(
        TrainBackendSpec(
            model_path=path,
            device="cpu",
            precision="fp32",
            optim=OptimConfig(max_grad_norm=None),
            micro_batch_size=4,
            num_threads=1,
            packing=packing,
        )
    )


def _direct_log_probs(model: object, batch: Batch, token_types: bool) -> torch.Tensor:
    """log p(next token) of the transformers model called by hand, [B, T-1]."""
    ids, attn = batch.tensors["input_ids"], batch.tensors["attention_mask"]
    kwargs = vision_model_inputs(batch)
    if token_types:
        kwargs["mm_token_type_ids"] = token_type_ids(ids, model.config.image_token_id)  # type: ignore[attr-defined]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False, **kwargs).logits  # type: ignore[operator]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * attn[:, 1:]


def test_token_types_give_the_hand_computed_3d_positions(vl: tuple[str, object]) -> None:
    """Row 1 (an 84x56 then a 56x56 image): image tokens get (t, h, w) positions of their
    grid from the position p where the image starts, text after an image continues at p +
    max(h, w) of its merged grid."""
    path, proc = vl
    (ids, vision) = _prompts(proc)[1]
    pad_id = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")  # type: ignore[attr-defined]
    row = torch.tensor([ids])
    types = token_type_ids(row, pad_id)
    assert types.dtype == torch.int32 and int(types.sum()) == 6 + 4
    trainer = _trainer(path, packing=False)
    assert trainer._image_token == pad_id
    rope = rope_module(trainer.model)
    assert vision is not None
    pos, delta = rope.get_rope_index(row, types, vision.image_grid_thw)
    p = ids.index(pad_id)  # the first image's first token (after <|vision_start|>)
    first = pos[:, 0, p : p + 6].tolist()  # merged grid (1, 2, 3): rows of 3 tokens
    assert first == [[p] * 6, [p, p, p, p + 1, p + 1, p + 1], [p, p + 1, p + 2] * 2]
    after = p + 3  # <|vision_end|> of image 1 continues at p + max(2, 3)
    assert pos[:, 0, p + 6].tolist() == [after] * 3
    q = p + 6 + (ids[p + 6 :].index(pad_id))  # the second image's first token
    q_pos = after + (q - (p + 6))  # the text between them advances one per token
    assert pos[:, 0, q : q + 4].tolist() == [
        [q_pos] * 4,
        [q_pos, q_pos, q_pos + 1, q_pos + 1],
        [q_pos, q_pos + 1, q_pos, q_pos + 1],
    ]
    # rope delta: 10 image tokens take max(2,3) + max(2,2) = 5 positions
    assert delta.tolist() == [[5 - 10]]


def test_trainer_and_reference_log_probs_use_3d_positions(vl: tuple[str, object]) -> None:
    """The trainer (padded and packed) and the reference worker give the log-probs of the
    model called by hand with mm_token_type_ids, not those of the 1-D forward."""
    from roll_core.workers.reference import Reference

    path, proc = vl
    prompts = _prompts(proc)
    rows = [ids + [100 + i] * (3 + i) for i, (ids, _) in enumerate(prompts)]
    batch = _batch(rows, [v for _, v in prompts], proc.tokenizer.pad_token_id)  # type: ignore[attr-defined]
    padded = _trainer(path, packing=False)
    want = _direct_log_probs(padded.model.eval(), batch, token_types=True)
    one_d = _direct_log_probs(padded.model, batch, token_types=False)
    image_rows = [i for i, s in enumerate(SIZES) if s]
    assert (want - one_d)[image_rows].abs().max() > 1e-3  # the positions matter here
    torch.testing.assert_close((want - one_d)[2], torch.zeros_like(want[2]))  # text row
    got = {"padded": padded.log_probs(batch), "packed": _trainer(path, True).log_probs(batch)}
    for packing in (False, True):
        ref = Reference(
            model_path=path, device="cpu", num_threads=1, rank=0, world_size=1, packing=packing
        )
        ref.setup()
        got[f"reference packed={packing}"] = ref.log_probs(batch)
    for name, value in got.items():
        torch.testing.assert_close(value, want, rtol=0, atol=1e-5, msg=name)


def _trainer_log_probs(path: str, proc: object, prompts, completions) -> tuple:  # type: ignore[no-untyped-def]
    """The trainer's log-probs of each completion's tokens (padded and packed), and the
    1-D forward's, each a list of per-row tensors."""
    rows = [ids + c.response_ids for (ids, _), c in zip(prompts, completions, strict=True)]
    batch = _batch(rows, [v for _, v in prompts], proc.tokenizer.pad_token_id)  # type: ignore[attr-defined]
    padded = _trainer(path, packing=False)
    results = [padded.log_probs(batch), _trainer(path, True).log_probs(batch)]
    results.append(_direct_log_probs(padded.model.eval(), batch, token_types=False))
    out = []
    for lp in results:
        out.append(
            [
                lp[i, len(ids) - 1 : len(ids) - 1 + len(c.response_ids)]
                for i, ((ids, _), c) in enumerate(zip(prompts, completions, strict=True))
            ]
        )
    return out


def _until(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting for the engine"
        time.sleep(0.005)


def test_hf_sampling_log_probs_are_the_trainers(vl: tuple[str, object]) -> None:
    """Sampled responses of rows with images of different sizes (and a text row), batched in
    the fixed-batch path and decoding together in the continuous-batching engine (three rows
    joining a running one): each token's behaviour log-prob is the trainer's, and not the
    1-D forward's, so every row kept its own 3-D positions through the decoding steps."""
    path, proc = vl
    prompts = _prompts(proc)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    reqs = [Request(i, ids, seed=11 + i, vision=v) for i, (ids, v) in enumerate(prompts)]
    b = HFInferBackend(model_path=path, device="cpu", num_threads=1)
    try:
        fixed = b.generate(reqs, params)
        long = SamplingParams(max_new_tokens=16, temperature=1.0)
        running: list[int] = []  # live rows at each prefill: rows join a running batch
        prefill = b.engine._prefill
        b.engine._prefill = lambda admit: running.append(len(b.engine._live)) or prefill(admit)  # type: ignore[method-assign]
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(b.generate_request, reqs[1], long)
            _until(lambda: b.engine.steps >= 2 or first.done())  # row 1 is decoding alone
            b.pause()  # the others queue while row 1 is mid-response, then join it
            later = [pool.submit(b.generate_request, r, params) for r in reqs if r is not reqs[1]]
            _until(lambda: b.engine.in_flight() == len(later) + (not first.done()))
            b.resume()
            streamed = [f.result(timeout=300) for f in later]
            streamed.insert(1, first.result(timeout=300))
        assert running[0] == 0 and max(running[1:]) >= 1  # row 1 decoded, then others joined
    finally:
        b.close()
    for name, completions in (("generate", fixed), ("engine", streamed)):
        assert all(len(c.response_ids) > 0 for c in completions)
        padded, packed, one_d = _trainer_log_probs(path, proc, prompts, completions)
        worst_1d = 0.0
        for i, c in enumerate(completions):
            behaviour = torch.tensor(c.log_probs)
            for trained in (padded[i], packed[i]):
                torch.testing.assert_close(trained, behaviour, rtol=0, atol=1e-4, msg=name)
            if SIZES[i]:
                worst_1d = max(worst_1d, float((one_d[i] - behaviour).abs().max()))
        assert worst_1d > 1e-3, name  # 1-D positions would not have given these log-probs


def test_greedy_generate_of_trainer_and_teacher_uses_3d_positions(vl: tuple[str, object]) -> None:
    """The trainer's and the teacher's `generate` (left-padded rows of different image sizes):
    the language model's prefill positions are each row's own 3-D positions, and the first
    decoding step continues every row at its last position + 1 (its own rope delta)."""
    from roll_core.workers.teacher import Teacher

    path, proc = vl
    prompts = _prompts(proc)
    trainer = _trainer(path, packing=False)
    teacher = Teacher(
        spec=TrainBackendSpec(model_path=path, device="cpu", num_threads=1), rank=0, world_size=1
    )
    teacher.setup()
    rope = rope_module(trainer.model)
    pad_id = trainer._image_token
    alone = []
    for ids, vision in prompts:  # each row's positions computed on its own, no padding
        row = torch.tensor([ids])
        grid = vision.image_grid_thw if vision is not None else None
        if grid is None:
            alone.append(torch.arange(len(ids)).expand(3, -1))
        else:
            alone.append(rope.get_rope_index(row, token_type_ids(row, pad_id), grid)[0][:, 0])
    # the image rows' last positions run behind their lengths (3-D), the text row's do not
    behind = [
        len(ids) - 1 - int(a[:, -1].max()) for a, (ids, _) in zip(alone, prompts, strict=True)
    ]
    assert behind == [2, 5, 0, 4]  # 4 tokens in 2 positions, 6 in 3 + 4 in 2, 8 in 4
    width = max(len(ids) for ids, _ in prompts)
    for name, model, generate in (
        ("trainer", trainer.model, trainer.generate),
        ("teacher", teacher.model, teacher.generate),
    ):
        seen: list[torch.Tensor] = []

        def keep(_module, _args, kwargs, seen=seen):  # type: ignore[no-untyped-def]
            seen.append(kwargs["position_ids"].clone())

        hook = model.model.language_model.register_forward_pre_hook(keep, with_kwargs=True)
        try:
            generate([ids for ids, _ in prompts], max_new_tokens=2, vision=[v for _, v in prompts])
        finally:
            hook.remove()
        prefill, step = seen[0], seen[1]  # [4, B, L]: text row, then t, h, w
        for i, (ids, _) in enumerate(prompts):
            torch.testing.assert_close(prefill[1:, i, width - len(ids) :], alone[i], msg=name)
            assert step[1:, i, 0].tolist() == (alone[i][:, -1] + 1).tolist(), name
