"""`eval.exact_match` with a reasoning chat template (issue 32, item 8): the real Qwen vocabulary
and the public Qwen3 template, where `<think>`/`</think>` are normal added tokens, so the
decoded output of a correct model is `<think>\\n\\n</think>\\n\\n5`."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import AutoTokenizer

from roll_core.data.chat import reasoning_format
from roll_core.pipelines.supervised import exact_match


class ScriptedCluster:
    """A cluster whose greedy output for every prompt is `continuation`, cut at the budget."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation
        self.budgets: list[int] = []

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int) -> list[list[int]]:
        self.budgets.append(max_new_tokens)
        return [self.continuation[:max_new_tokens] for _ in prompts]


def test_reasoning_format_of_real_qwen_templates(qwen_real) -> None:
    qwen3 = reasoning_format(AutoTokenizer.from_pretrained(str(qwen_real("tokenizer-qwen3"))))
    # the empty block Qwen3's template writes into the last assistant turn: <think> \n\n </think> \n\n
    assert qwen3.preamble == "<think>\n\n</think>\n\n" and qwen3.preamble_tokens == 4
    assert qwen3.answer("<think>\n\n</think>\n\n5") == "5"
    assert qwen3.answer("<think>\n2+3 is 5\n</think>\n\n 5") == " 5"  # a non-empty block
    assert qwen3.answer("<think>\n2+3 is") == ""  # ran out of budget while reasoning
    assert qwen3.answer("5") == "5"
    qwen25 = reasoning_format(AutoTokenizer.from_pretrained(str(qwen_real("tokenizer-qwen2.5"))))
    assert (qwen25.markers, qwen25.preamble, qwen25.preamble_tokens) == (None, "", 0)
    assert qwen25.answer("</think>5") == "</think>5"  # not a reasoning template: as is


def test_exact_match_strips_the_block_and_counts_it_in_the_budget(qwen_real) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen_real("tokenizer-qwen3")))
    # what a model SFT-ed on Qwen3's template generates for "2+3": the empty block, then "5"
    out = tok.encode("<think>\n\n</think>\n\n5<|im_end|>", add_special_tokens=False)
    assert len(out) == 6  # 4 block tokens + "5" + <|im_end|>
    cluster = ScriptedCluster(out)
    data = SimpleNamespace(eval_prompts=[[1, 2], [3]], eval_answers=["5", "6"])
    ev = SimpleNamespace(batch_size=8, max_new_tokens=2)  # room for the answer and its eos
    # hand-computed: row 1 decodes to "5" after the block (hit), row 2 expects "6" (miss)
    assert exact_match(cluster, data, tok, ev) == 0.5
    assert cluster.budgets == [2 + 4]
