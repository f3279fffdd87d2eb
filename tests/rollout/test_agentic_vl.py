"""Agentic rollout with image observations on the tiny VLM (real hf backend, fp32, local executor).

Token-in/token-out with images: every turn is generated from the trace so far *and* the images
in it; the trained row holds exactly those ids and those pixel values, and the trainer's
recomputed log-probs (which do depend on the pixels) match the generation's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from roll_core.backends.infer import SamplingParams
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.data import Batch
from roll_core.engine import Cluster
from roll_core.envs import FrozenLakeEnv
from roll_core.envs.base import observation_images
from roll_core.errors import ModelError
from roll_core.models import load_tokenizer, materialize_builtin
from roll_core.models.vision import load_processor
from roll_core.rollout.agentic import (
    ChatFormat,
    EnvSpec,
    RolloutSettings,
    env_producer,
    step_batch,
    trajectory_batch,
)

MAP = "SFF/FHF/FFG"  # 3x3 cells of 14 px: 42x42, resized by the processor to 56x56 = 4x4 patches
TOKENS_PER_IMAGE = 4  # 4x4 patches, 2x2 merged


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(materialize_builtin("tiny-qwen2.5-vl", tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def parts(
    model_path: str,
    hf_infer: Callable[[str], Cluster],
    fp32_trainer: Callable[[str], TorchTrainBackend],
) -> tuple[Any, Any, Cluster, TorchTrainBackend]:
    tok = load_tokenizer(model_path)
    return tok, load_processor(model_path, tok), hf_infer(model_path), fp32_trainer(model_path)


def env() -> FrozenLakeEnv:
    return FrozenLakeEnv(map=MAP, max_steps=3, obs_mode="image")


def rollout(parts: tuple, mode: str) -> list:
    tok, proc, infer, _ = parts
    settings = RolloutSettings(
        params=SamplingParams(max_new_tokens=5, temperature=1.0),
        group_size=2,
        mode=mode,
        history_window=1,
        max_context=4096,
    )
    spec = EnvSpec("lake", env, "Lake.", 1)
    mgr = env_producer(infer=infer, tokenizer=tok, specs=[spec], settings=settings, processor=proc)
    try:
        return mgr.next_batch(1).groups
    finally:
        mgr.close()


def replayed_pixels(proc: Any, tok: Any, traj: Any) -> list[torch.Tensor]:
    """The processor's pixel values of each observation of the episode, replayed."""
    replay = env()
    obs, _ = replay.reset(traj.seed)
    pixels = [proc.process_images(observation_images(obs)).pixel_values]
    for turn in traj.turns[:-1]:
        obs, *_ = replay.step(tok.decode(turn.response_ids, skip_special_tokens=True))
        pixels.append(proc.process_images(observation_images(obs)).pixel_values)
    return pixels


def gap(trainer: TorchTrainBackend, batch: Batch) -> float:
    recomputed = trainer.log_probs(batch)
    mask = batch.tensors["response_mask"]
    return float(((recomputed - batch.tensors["behaviour_log_probs"]).abs() * mask).max())


def test_trajectory_rows_hold_the_generated_ids_and_images(parts: tuple) -> None:
    tok, proc, _, trainer = parts
    pad = proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    groups = rollout(parts, "trajectory")
    for traj in groups[0]:
        assert traj.ok and len(traj.turns) == 3, traj.error
        pixels = replayed_pixels(proc, tok, traj)
        for k, turn in enumerate(traj.turns):
            # generation saw the trace so far: ids, and one image per observation so far
            assert traj.trace.ids[: len(turn.prompt_ids)] == turn.prompt_ids
            assert turn.prompt_ids.count(pad) == TOKENS_PER_IMAGE * (k + 1)
            assert turn.vision.image_grid_thw.tolist() == [[1, 4, 4]] * (k + 1)
            assert torch.equal(turn.vision.pixel_values, torch.cat(pixels[: k + 1]))
        assert traj.trace.ids.count(pad) == TOKENS_PER_IMAGE * 3
        assert traj.trace.vision().equal(traj.turns[-1].vision)

    batch = trajectory_batch(groups, pad_id=tok.pad_token_id)
    for row, traj in enumerate(groups[0]):
        assert torch.equal(
            batch.non_tensors["pixel_values"][row], traj.turns[-1].vision.pixel_values
        )
    assert gap(trainer, batch) < 2e-4
    # the pixels matter: the same ids with other images give other log-probs
    blank = Batch(
        tensors=batch.tensors,
        non_tensors={
            **batch.non_tensors,
            "pixel_values": [torch.zeros_like(p) for p in batch.non_tensors["pixel_values"]],
        },
    )
    assert gap(trainer, blank) > 1e-3


def test_step_rows_carry_the_images_of_their_window(parts: tuple) -> None:
    tok, _, _, trainer = parts
    groups = rollout(parts, "step")
    batch = step_batch(groups, pad_id=tok.pad_token_id)
    turns = [t for traj in groups[0] for t in traj.turns]
    assert len(batch) == len(turns) == 6
    for row, turn in enumerate(turns):
        n = len(turn.prompt_ids) + len(turn.response_ids)
        assert batch.tensors["input_ids"][row, :n].tolist() == turn.prompt_ids + turn.response_ids
        assert batch.non_tensors["pixel_values"][row] is turn.vision.pixel_values
    # history_window 1: the first turn sees one picture, later turns the previous one too
    assert [t.vision.num_images for t in turns] == [1, 2, 2] * 2
    assert gap(trainer, batch) < 2e-4


def test_a_text_model_cannot_take_image_observations(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tok = load_tokenizer(str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("c"))))
    obs, _ = env().reset(0)
    with pytest.raises(ModelError, match="text-only model"):
        ChatFormat(tok).first_prompt("Lake.", obs)


def test_a_vlm_never_generates_image_placeholders(model_path: str) -> None:
    """A response with an image placeholder would hold more image tokens than images, which
    breaks the next turn and training: the hf backend suppresses the vision tokens."""
    from roll_core.backends.infer import Request
    from roll_core.backends.infer.hf import HFInferBackend

    backend = HFInferBackend(model_path=model_path, device="cpu", num_threads=1)
    tok = backend.tokenizer
    vision_ids = [tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>")]
    assert set(vision_ids) <= set(backend.suppress)
    head = backend.model.get_output_embeddings()
    bias = torch.zeros(head.weight.shape[0])
    bias[vision_ids] = 50.0  # the model now prefers the vision tokens by far

    def prefer_vision(_module: Any, _inputs: Any, logits: torch.Tensor) -> torch.Tensor:
        return logits + bias

    hook = head.register_forward_hook(prefer_vision)
    try:
        prompt = tok("hello", add_special_tokens=False)["input_ids"]
        params = SamplingParams(max_new_tokens=6, temperature=1.0)
        (out,) = backend.generate([Request(0, prompt, seed=1)], params)
        backend.suppress = None  # the same request without suppression: only vision tokens
        (raw,) = backend.generate([Request(0, prompt, seed=1)], params)
    finally:
        hook.remove()
    assert out.response_ids and not set(out.response_ids) & set(vision_ids)
    assert set(raw.response_ids) <= set(vision_ids)
