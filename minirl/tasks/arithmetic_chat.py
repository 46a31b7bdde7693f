"""Arithmetic facts as chat questions, answered in a few tokens: the real model's first RL task.

Hand-written (data plumbing, like `word_problems`). Each row asks one single-digit fact of the
four operations (addition and times tables, and their inverses, subtraction and division) as a
conversation, a system turn with the instruction and a user turn with the question, and keeps
the answer as a number:

    {"prompt": [{"role": "system", "content": "Reply with just the number."},
                {"role": "user", "content": "What is 7 * 8?"}],
     "answer": 56}

`final_number_reward` scores a completion 1 when the last number it writes is the answer:
"56", "7 * 8 = 56" and "The answer is 56." all score 1, "To multiply 7 by 8, we" scores 0 (the
flexible extraction of GSM8K evaluations; `math_reward` wants the number alone, or `#### N`).
Why this task for SmolLM2-135M-Instruct: it knows most of these facts (asked to reply with just
the number, its greedy answers to the times tables are mostly right) but, as a chat model,
greedily starts to explain ("To add 4 and 5, we need to combine ...") and, within a budget of 10
new tokens, rarely reaches the number. RL with that budget teaches it to answer first, in
minutes on a CPU, and the held-out accuracy shows it. The lesson is the format, not new
arithmetic: a 135 M model learns little arithmetic in a few hundred samples.

    python -m minirl.tasks.arithmetic_chat --out data/arithmetic_chat

writes OUT/train.jsonl, OUT/test.jsonl and OUT/meta.json (the arguments, so that a test can
regenerate the files and compare them byte for byte). Held out means held out: a fact family,
{a + b, b + a, c - a, c - b} with c = a + b, or {a * b, b * a, c / a, c / b} with c = a * b,
falls on one side of the split as a whole, so no test question is a training question with its
operands swapped or inverted.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from minirl.runtime.completions import completion_text
from minirl.runtime.io import atomic_write_text
from minirl.runtime.math_answer import NUMBER, parse_number

FACTS_FORMAT_VERSION = 1   # bump when a change to this file changes what it writes for a seed
FACTS_SYSTEM = "Reply with just the number."


def families() -> list[list[tuple[str, int]]]:
    """Every fact family as [(question, answer), ...]: addition over 1..9 and multiplication over 2..9.

    a + b and b + a are one question when a == b; subtraction and division are the family's
    inverses (c - a = b, c / a = b), so every answer is a whole number from 1 to 81.
    """
    found = []
    for op, inverse, low, combine in (("+", "-", 1, int.__add__), ("*", "/", 2, int.__mul__)):
        for a in range(low, 10):
            for b in range(a, 10):
                c = combine(a, b)
                pairs = {(a, b), (b, a)}
                found.append([(f"{x} {op} {y}", c) for x, y in sorted(pairs)] +
                             [(f"{c} {inverse} {x}", y) for x, y in sorted(pairs)])
    return found


def fact_prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": FACTS_SYSTEM}, {"role": "user", "content": f"What is {question}?"}]


def generate_facts(test_fraction: float = 0.25, seed: int = 0) -> dict[str, list[dict]]:
    """{"train": rows, "test": rows}, rows {"prompt": messages, "answer": int}, shuffled with `seed`.

    The families are shuffled and the first `test_fraction` of them held out, whole.
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction={test_fraction!r}: must be between 0 and 1 (exclusive)")
    rng = random.Random(seed)
    shuffled = families()
    rng.shuffle(shuffled)
    cut = round(len(shuffled) * test_fraction)
    splits = {"test": shuffled[:cut], "train": shuffled[cut:]}
    out = {}
    for name, fams in splits.items():
        rows = [{"prompt": fact_prompt(q), "answer": a} for fam in fams for q, a in fam]
        rng.shuffle(rows)
        out[name] = rows
    return {"train": out["train"], "test": out["test"]}


def final_number_reward(prompts, completions, answer, **columns) -> list[float]:
    """1.0 where the last number a completion writes equals the row's answer, else 0.0 (TRL signature).

    completions: list[str] or chat messages; answer: one int per completion. Numbers are read
    as `math_answer` reads them ("1,234", "$5", "56.0"); a completion without a number scores 0.
    """
    if len(completions) != len(answer):
        raise ValueError(f"final_number_reward: {len(completions)} completions but {len(answer)} answers")
    rewards = []
    for completion, target in zip(completions, answer, strict=True):
        text = completion_text(completion)
        found = list(NUMBER.finditer(text)) if isinstance(text, str) else []
        value = parse_number(found[-1].group(0)) if found else None
        rewards.append(1.0 if value is not None and value == target else 0.0)
    return rewards


def write_facts(out: str | Path, test_fraction: float = 0.25, seed: int = 0) -> list[Path]:
    """Write OUT/train.jsonl, OUT/test.jsonl (one JSON row a line) and OUT/meta.json (how they were made)."""
    out = Path(out)
    splits = generate_facts(test_fraction, seed)
    paths = [atomic_write_text(out / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
             for name, rows in splits.items()]
    meta = {"generator": "python -m minirl.tasks.arithmetic_chat", "format_version": FACTS_FORMAT_VERSION, "seed": seed,
            "test_fraction": test_fraction, "n_train": len(splits["train"]), "n_test": len(splits["test"])}
    paths.append(atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n"))
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minirl.tasks.arithmetic_chat",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl, test.jsonl, meta.json")
    parser.add_argument("--test-fraction", type=float, default=0.25,
                        help="share of the fact families held out (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        paths = write_facts(args.out, args.test_fraction, args.seed)
    except ValueError as err:
        parser.error(f"argument --test-fraction: {err}")
    for path in paths:
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
