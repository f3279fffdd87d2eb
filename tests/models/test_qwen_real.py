"""The real-vocabulary Qwen fixture (tests/qwen_real.py) is what it claims to be."""

from __future__ import annotations

from transformers import AutoConfig, AutoTokenizer

from tests.qwen_real import ADDED_TOKENS, VOCAB_SIZE


def test_real_qwen_tokenizer_ids_and_round_trip(qwen_real) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen_real("tokenizer-qwen3")))
    # Public Qwen2/2.5/3 ids: "Hello" 9707, " world" 1879, "!" 0, "\n" 198, "\n\n" 271.
    assert tok.encode("Hello world!", add_special_tokens=False) == [9707, 1879, 0]
    assert tok.encode("\n\n", add_special_tokens=False) == [271]
    assert tok.encode("user\n", add_special_tokens=False) == [872, 198]
    for tid, content, special in ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(content) == tid
        assert tok.added_tokens_decoder[tid].special == special, content
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (151645, 151643, None)
    text = "Hi 你好，世界 1234\n\tdef f(x):  return x**2 <|im_start|>user\n<think>ok</think>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # <think> is a normal added token: skip_special_tokens keeps it (as real Qwen3 does).
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<|im_start|>", "")


def test_real_qwen3_template_writes_empty_think(qwen_real) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen_real("tokenizer-qwen3")))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nyo"
        "<|im_end|>\n"
    )
    msgs.append({"role": "user", "content": "again"})
    assert "<think>" not in tok.apply_chat_template(msgs, tokenize=False)
    tok25 = AutoTokenizer.from_pretrained(str(qwen_real("tokenizer-qwen2.5")))
    assert tok25.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_real_qwen_tiny_models(qwen_real) -> None:
    dense = AutoConfig.from_pretrained(str(qwen_real("qwen3")))
    moe = AutoConfig.from_pretrained(str(qwen_real("qwen3-moe")))
    assert (dense.model_type, moe.model_type) == ("qwen3", "qwen3_moe")
    assert dense.vocab_size == moe.vocab_size == VOCAB_SIZE
    assert dense.head_dim == 32 and moe.num_experts == 4
