"""The built-in tiny VLM, its processor, and token-in/token-out of image prompts.

Trainer log-probs of generated image samples equal the hf sampler's (fp32) and the training
batch holds exactly the generated ids and the images that generated them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from roll_core.backends.infer import Request, SamplingParams
from roll_core.backends.infer.hf import HFInferBackend
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.config.schema import OptimConfig
from roll_core.data.chat import encode_chat_images, image_message
from roll_core.data.vision import sample_vision
from roll_core.errors import ModelError
from roll_core.models import materialize_builtin, model_summary
from roll_core.models.loading import count_parameters, is_vision_model, load_causal_lm
from roll_core.models.vision import load_processor
from roll_core.rollout.batch import build_rl_batch
from roll_core.rollout.one_turn import Prompt, Sample

VLM = "builtin:tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize_builtin(VLM, tmp_path_factory.mktemp("cache"))


def test_tiny_vlm_is_a_hf_model_directory_with_its_processor(vlm_dir: Path) -> None:
    names = {p.name for p in vlm_dir.iterdir()}
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= names
    assert is_vision_model(str(vlm_dir)) and not is_vision_model("builtin:tiny-qwen3")
    model = load_causal_lm(str(vlm_dir))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    summary = model_summary(VLM)
    # the config-only estimate (LM + vision tower) is exact for the builtin
    assert summary["approx_params"] == count_parameters(model) == 692_672
    assert summary["vision_params"] == count_parameters(model.model.visual)
    proc = load_processor(str(vlm_dir))
    assert (proc.image_token, proc.merge_size) == ("<|image_pad|>", 2)
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision


def test_rematerializing_the_tiny_vlm_is_byte_identical(vlm_dir: Path, tmp_path: Path) -> None:
    again = materialize_builtin(VLM, tmp_path)
    files = sorted(p.name for p in vlm_dir.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    assert all((vlm_dir / f).read_bytes() == (again / f).read_bytes() for f in files)


def test_image_placeholders_expand_to_one_token_per_merged_patch(vlm_dir: Path) -> None:
    proc = load_processor(str(vlm_dir))
    pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    small, large = Image.new("RGB", (56, 56)), Image.new("RGB", (300, 200))
    ids, vision = encode_chat_images(
        proc, [image_message("hi", 2)], [small, large], add_generation_prompt=True
    )
    # 56x56: 4x4 patches of 14 -> 2x2 merged = 4 tokens. 300x200 is over max_pixels (112*112):
    # scaled by sqrt(300*200 / 112**2) = 2.19 and floored to multiples of 28: 112x84 -> 8x6
    # patches -> 4x3 = 12 tokens
    assert vision.image_grid_thw.tolist() == [[1, 4, 4], [1, 6, 8]]
    assert ids.count(pad) == 4 + 12
    assert vision.pixel_values.shape == (16 + 48, 3 * 2 * 14 * 14)
    text = proc.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    assert text.endswith("<|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="1 image placeholder"):
        encode_chat_images(proc, [image_message("hi", 1)], [], add_generation_prompt=True)


def test_processor_of_a_text_model_is_refused() -> None:
    with pytest.raises(ModelError, match="qwen3"):
        load_processor("builtin:tiny-qwen3")


def test_token_in_token_out_and_trainer_log_probs_equal_the_samplers(vlm_dir: Path) -> None:
    path = str(vlm_dir)
    proc = load_processor(path)
    images = [
        [Image.new("RGB", (56, 56), (255, 0, 0))],
        [Image.new("RGB", (84, 56), (0, 0, 255)), Image.new("RGB", (56, 56), (0, 255, 0))],
        [],  # a text-only row in the same batch
    ]
    prompts = []
    for i, imgs in enumerate(images):
        ids, vision = encode_chat_images(
            proc, [image_message("count" + "!" * i, len(imgs))], imgs, add_generation_prompt=True
        )
        prompts.append(Prompt(i, ids, {}, vision=vision))
    infer = HFInferBackend(model_path=path)
    requests = [Request(p.index, p.prompt_ids, 7 + p.index, vision=p.vision) for p in prompts]
    completions = infer.generate(requests, SamplingParams(max_new_tokens=6, temperature=1.0))
    samples = [
        Sample(c.request_id, 0, prompts[c.request_id], c.response_ids, c.log_probs, "length", 0)
        for c in completions
    ]
    batch = build_rl_batch([samples], pad_id=proc.tokenizer.pad_token_id)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        n = len(p.prompt_ids) + len(c.response_ids)
        assert batch.tensors["input_ids"][i, :n].tolist() == p.prompt_ids + c.response_ids
        assert (p.vision is None and sample_vision(batch, i) is None) or sample_vision(
            batch, i
        ).equal(p.vision)
    # micro-batches of 2 split the image rows across forward passes
    trainer = TorchTrainBackend(
        TrainBackendSpec(model_path=path, optim=OptimConfig(), total_steps=1, micro_batch_size=2)
    )
    log_probs = trainer.log_probs(batch)
    mask = batch.tensors["response_mask"]
    gap = ((log_probs - batch.tensors["behaviour_log_probs"]) * mask).abs().max()
    assert mask.sum() == sum(len(c.response_ids) for c in completions) > 0
    assert float(gap) < 1e-4
    # the images matter: the same ids with another image give other log-probs
    other = batch.select([0, 1, 2])
    other.non_tensors["pixel_values"] = [
        torch.zeros_like(v) if v is not None else None for v in other.non_tensors["pixel_values"]
    ]
    assert float(((trainer.log_probs(other) - log_probs) * mask).abs().max()) > 1e-3


def test_a_chat_template_kept_with_the_processor_is_used(vlm_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    model = tmp_path / "vlm"
    shutil.copytree(vlm_dir, model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_processor(str(model)).tokenizer.chat_template == template
