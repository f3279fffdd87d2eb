"""How far a student is from a teacher on the student's own samples, computed without roll's
pipeline: the check behind docs/distill.md "Checked: the large sampled reverse KL was real".

For each held-out prompt (rendered by roll's chat-template path, `encode_prompt`), the student
samples a response at `--temperature` (at most 8 tokens, stopping at the end-of-turn token).
Both models then score it with one unpadded Hugging Face forward each. Printed per response
token, averaged:

* the sampled k1 estimate of the reverse KL, `log q(y_t) - log p(y_t)` (what
  `distill/reverse_kl` logs in `mode: token`);
* the exact reverse KL at the same positions, `sum_v q(v) (log q(v) - log p(v))`;
* the exact forward KL there, `sum_v p(v) (log p(v) - log q(v))`;

then the k1 estimate by response position and by sampled token, and the student's sampled
exact-match rate. q is the student, p the teacher, both at `--temperature`.

    OMP_NUM_THREADS=1 python benchmarks/distill_divergence.py STUDENT_DIR TEACHER_DIR \
        [--prompts 150] [--temperature 1.0] [--data data/tiny-arith/test.jsonl]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from roll_core.data import encode_prompt
from roll_core.models import load_causal_lm, load_tokenizer


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("student")
    parser.add_argument("teacher")
    parser.add_argument("--prompts", type=int, default=150)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--data", default="data/tiny-arith/test.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tok = load_tokenizer(args.teacher)
    student = load_causal_lm(args.student).eval()
    teacher = load_causal_lm(args.teacher).eval()
    with open(args.data) as f:
        rows = [json.loads(line) for line in f][: args.prompts]
    k1: list[float] = []
    exact: list[float] = []
    forward: list[float] = []
    by_position: dict[int, list[float]] = defaultdict(list)
    by_token: dict[str, list[float]] = defaultdict(list)
    correct = 0
    with torch.no_grad():
        for row in rows:
            prompt = encode_prompt(tok, row["prompt"])
            ids = list(prompt)
            for _ in range(args.max_new_tokens):
                logits = student(torch.tensor([ids])).logits[0, -1].float() / args.temperature
                ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1)))
                if ids[-1] == tok.eos_token_id:
                    break
            x = torch.tensor([ids])
            q = torch.log_softmax(student(x).logits[0, :-1].float() / args.temperature, -1)
            p = torch.log_softmax(teacher(x).logits[0, :-1].float() / args.temperature, -1)
            for k, pos in enumerate(range(len(prompt) - 1, len(ids) - 1)):
                token = ids[pos + 1]
                term = float(q[pos, token] - p[pos, token])
                k1.append(term)
                exact.append(float((q[pos].exp() * (q[pos] - p[pos])).sum()))
                forward.append(float((p[pos].exp() * (p[pos] - q[pos])).sum()))
                by_position[k].append(term)
                by_token[tok.decode([token])].append(term)
            answer = tok.decode(ids[len(prompt) :], skip_special_tokens=True).strip()
            correct += answer == row["answer"]
    print(f"prompts {len(rows)}, response tokens {len(k1)}, temperature {args.temperature}")
    print(f"sampled k1 reverse KL / token   {mean(k1):.3f}")
    print(f"exact reverse KL / token        {mean(exact):.3f}")
    print(f"exact forward KL / token        {mean(forward):.3f}")
    print(
        "k1 by response position:", {k: round(mean(v), 2) for k, v in sorted(by_position.items())}
    )
    common = sorted(by_token.items(), key=lambda kv: -len(kv[1]))
    print("k1 by sampled token (n >= 5):",
          {t: (round(mean(v), 2), len(v)) for t, v in common if len(v) >= 5})  # fmt: skip
    print(f"student's sampled exact match   {correct / max(len(rows), 1):.3f}")


if __name__ == "__main__":
    main()
