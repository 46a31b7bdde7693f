"""A small set of GSM8K-style word problems, generated from templates and a seed (no copied data set).

Hand-written (data plumbing; the verifier it is scored by, `minirl.runtime.math_answer`, is
taught in notebook 00). Each row has GSM8K's two fields, renamed the way TRL's trainers
read them: `prompt` (the question, with an instruction to end on `#### <number>`) and
`answer` (a worked solution with GSM8K's calculator annotations, then `#### N`):

    {"prompt": "Question: Ava has 12 pencils. ...\\nAnswer:",
     "answer": "Ava buys 3 * 4 = <<3*4=12>>12 pencils.\\nAva has 12 + 12 = <<12+12=24>>24 pencils now.\\n#### 24"}

With `chat=True` the prompt is a conversation instead (a system turn with the instruction,
a user turn with the question), which `minirl.runtime.data_files.render_prompts` passes
through the tokenizer's chat template: the form an Instruct model is trained on.

    python -m minirl.tasks.word_problems --out data/word_problems --n-train 2000 --n-test 200
    python -m minirl.tasks.word_problems --out data/word_problems_chat --chat

writes OUT/train.jsonl, OUT/test.jsonl and OUT/meta.json (the arguments, so the files can be
regenerated and compared byte for byte). Held out means held out: a problem is its
template and its numbers (names and objects are decoration), and no test problem's template
and numbers occur in training. Simplified: ten templates of one to three steps with
integer answers, far easier and less varied than GSM8K's 8.5 k hand-written problems; enough
to watch an Instruct model learn a format and some arithmetic, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

from minirl.runtime.io import atomic_write_text

FORMAT_VERSION = 1   # bump when a change to this file changes what it writes for a seed
INSTRUCTION = "Solve the problem step by step, then give the final answer on its own line as: #### <number>"
SYSTEM = "You solve math word problems. Reason step by step, then give the final answer on its own last line as: " \
         "#### <number>"
PEOPLE = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kate", "Liam", "Maya",
         "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["pencils", "stickers", "marbles", "apples", "shells", "cards", "buttons", "stamps"]
GOODS = [("pie", "pies"), ("scarf", "scarves"), ("lamp", "lamps"), ("kite", "kites"), ("mug", "mugs")]


def _calc(expr: str, value: int) -> str:
    """GSM8K's calculator annotation: `3*4` and 12 -> `<<3*4=12>>12`."""
    return f"<<{expr}={value}>>{value}"


def buy_more(rng: random.Random):
    name, item = rng.choice(PEOPLE), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 9), rng.randint(2, 12)
    bought, total = b * c, a + b * c
    question = (f"{name} has {a} {item}. {name} buys {b} packs of {c} {item} each. "
                f"How many {item} does {name} have now?")
    steps = [f"{name} buys {b} * {c} = {_calc(f'{b}*{c}', bought)} {item}.",
             f"{name} has {a} + {bought} = {_calc(f'{a}+{bought}', total)} {item} now."]
    return (a, b, c), question, steps, total


def earnings(rng):
    name, (_, goods) = rng.choice(PEOPLE), rng.choice(GOODS)
    a, p, d = rng.randint(2, 30), rng.randint(2, 15), rng.randint(2, 7)
    daily, total = a * p, a * p * d
    question = (f"{name} sells {a} {goods} a day at ${p} each. How many dollars does {name} make in {d} days?")
    steps = [f"{name} makes {a} * {p} = {_calc(f'{a}*{p}', daily)} dollars a day.",
             f"In {d} days that is {daily} * {d} = {_calc(f'{daily}*{d}', total)} dollars."]
    return (a, p, d), question, steps, total


def left_after(rng):
    name, item = rng.choice(PEOPLE), rng.choice(ITEMS)
    a, b = rng.randint(3, 25), rng.randint(2, 9)
    c = rng.randint(2, a * b - 2)
    filled, left = a * b, a * b - c
    question = (f"A box holds {a} {item}. {name} fills {b} boxes, then gives {c} {item} to a friend. "
                f"How many {item} does {name} have left?")
    steps = [f"{name} fills {b} * {a} = {_calc(f'{b}*{a}', filled)} {item} into boxes.",
             f"After giving {c} away, {filled} - {c} = {_calc(f'{filled}-{c}', left)} {item} are left."]
    return (a, b, c), question, steps, left


def money_left(rng):
    name, (good, _), (good2, _) = rng.choice(PEOPLE), *rng.sample(GOODS, 2)
    b = rng.randint(2, 40)
    rest = 2 * rng.randint(2, 40)
    a = b + rest
    question = (f"{name} had ${a}. {name} spent ${b} on a {good} and half of what was left on a {good2}. "
                f"How many dollars does {name} have now?")
    steps = [f"After the {good}, {name} had {a} - {b} = {_calc(f'{a}-{b}', rest)} dollars.",
             f"Half of that went on the {good2}, so {rest} / 2 = {_calc(f'{rest}/2', rest // 2)} dollars are left."]
    return (a, b), question, steps, rest // 2


def pages(rng):
    name = rng.choice(PEOPLE)
    a, d = rng.randint(5, 40), rng.randint(2, 9)
    total = a * d + rng.randint(2, 120)
    read, unread = a * d, total - a * d
    question = (f"A book has {total} pages. {name} reads {a} pages every day for {d} days. "
                f"How many pages are still unread?")
    steps = [f"{name} reads {a} * {d} = {_calc(f'{a}*{d}', read)} pages.",
             f"That leaves {total} - {read} = {_calc(f'{total}-{read}', unread)} pages unread."]
    return (total, a, d), question, steps, unread


def share(rng):
    name = rng.choice(PEOPLE)
    b, c = rng.randint(2, 6), rng.randint(4, 24)
    k = rng.choice([x for x in range(2, 10) if b * c % x == 0])    # never empty: b itself divides b * c
    each = b * c // k
    question = (f"{name} bakes {b} trays of {c} cookies and shares them equally among {k} friends. "
                f"How many cookies does each friend get?")
    steps = [f"{name} bakes {b} * {c} = {_calc(f'{b}*{c}', b * c)} cookies.",
             f"Each friend gets {b * c} / {k} = {_calc(f'{b * c}/{k}', each)} cookies."]
    return (b, c, k), question, steps, each


def discount(rng):
    good, _ = rng.choice(GOODS)
    pct = rng.choice([10, 20, 25, 50])
    p = rng.randint(1, 30) * 100 // math.gcd(pct, 100)            # a whole number of dollars off
    off = p * pct // 100
    question = f"A {good} costs ${p}. The shop takes {pct}% off. How many dollars does the {good} cost now?"
    steps = [f"The discount is {p} * {pct} / 100 = {_calc(f'{p}*{pct}/100', off)} dollars.",
             f"The {good} now costs {p} - {off} = {_calc(f'{p}-{off}', p - off)} dollars."]
    return (p, pct), question, steps, p - off


def factory(rng):
    item = rng.choice(ITEMS)
    a, h, d = rng.randint(12, 95), rng.randint(4, 12), rng.randint(3, 9)
    daily, total = a * h, a * h * d
    question = (f"A factory makes {a} {item} every hour and runs {h} hours a day. "
                f"How many {item} does it make in {d} days?")
    steps = [f"Each day it makes {a} * {h} = {_calc(f'{a}*{h}', daily)} {item}.",
             f"In {d} days it makes {daily} * {d} = {_calc(f'{daily}*{d}', total)} {item}."]
    return (a, h, d), question, steps, total


def ages(rng):
    name, other = rng.sample(PEOPLE, 2)
    a, k, d = rng.randint(2, 12), rng.randint(2, 5), rng.randint(1, 15)
    now, later = a * k, a * k + d
    question = (f"{name} is {a} years old. {other} is {k} times as old as {name}. "
                f"How old will {other} be in {d} years?")
    steps = [f"{other} is {a} * {k} = {_calc(f'{a}*{k}', now)} years old now.",
             f"In {d} years {other} will be {now} + {d} = {_calc(f'{now}+{d}', later)}."]
    return (a, k, d), question, steps, later


def trip(rng):
    v, h, w, g = rng.randint(20, 80), rng.randint(1, 5), rng.randint(20, 80), rng.randint(1, 5)
    first, second = v * h, w * g
    question = (f"A train travels at {v} miles per hour for {h} hours, then at {w} miles per hour for {g} hours. "
                f"How many miles does it travel in all?")
    steps = [f"First it travels {v} * {h} = {_calc(f'{v}*{h}', first)} miles.",
             f"Then {w} * {g} = {_calc(f'{w}*{g}', second)} miles.",
             f"In all {first} + {second} = {_calc(f'{first}+{second}', first + second)} miles."]
    return (v, h, w, g), question, steps, first + second


TEMPLATES = [buy_more, earnings, left_after, money_left, pages, share, discount, factory, ages, trip]


def make_prompt(question: str, chat: bool = False):
    """The `prompt` of a row: plain text ending in "Answer:", or a system and a user message."""
    if chat:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return f"Question: {question}\n{INSTRUCTION}\nAnswer:"


def generate(n_train: int = 2000, n_test: int = 200, seed: int = 0, chat: bool = False) -> dict[str, list[dict]]:
    """{"train": rows, "test": rows}, rows {"prompt", "answer"}; the same seed gives the same rows.

    Problems are drawn template by template in turn from one `random.Random(seed)`; the
    first `n_test` distinct problems (template and numbers) are held out, the next `n_train`
    distinct ones, none of them a held-out problem, are for training.
    """
    for name, n in (("n_train", n_train), ("n_test", n_test)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r}: must be an integer >= 1")
    rng = random.Random(seed)
    seen, splits = set(), {"test": [], "train": []}
    attempts = misses = 0
    while len(splits["train"]) < n_train:
        attempts += 1
        template = TEMPLATES[attempts % len(TEMPLATES)]
        numbers, question, steps, answer = template(rng)
        key = (template.__name__, numbers)
        if key in seen:
            misses += 1
            if misses > 10_000:                          # every template is (nearly) used up
                raise ValueError(f"n_train + n_test = {n_train + n_test}: the templates cannot make that many "
                                 f"distinct problems (they made {len(seen)}); ask for fewer")
            continue
        seen.add(key)
        misses = 0
        split = "test" if len(splits["test"]) < n_test else "train"
        splits[split].append({"prompt": make_prompt(question, chat), "answer": "\n".join(steps) + f"\n#### {answer}"})
    return {"train": splits["train"], "test": splits["test"]}


def write(out: str | Path, n_train: int = 2000, n_test: int = 200, seed: int = 0, chat: bool = False) -> list[Path]:
    """Write OUT/train.jsonl, OUT/test.jsonl (one JSON row a line) and OUT/meta.json (how they were made)."""
    out = Path(out)
    splits = generate(n_train, n_test, seed, chat)
    paths = [atomic_write_text(out / f"{name}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
             for name, rows in splits.items()]
    meta = {"generator": "python -m minirl.tasks.word_problems", "format_version": FORMAT_VERSION, "seed": seed,
            "n_train": n_train, "n_test": n_test, "chat": chat}
    paths.append(atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n"))
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minirl.tasks.word_problems", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl, test.jsonl, meta.json")
    parser.add_argument("--n-train", type=int, default=2000, help="training problems (default: %(default)s)")
    parser.add_argument("--n-test", type=int, default=200, help="held-out problems (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--chat", action="store_true",
                        help="prompts as a system and a user message, for a chat (Instruct) model's template")
    args = parser.parse_args(argv)
    try:
        paths = write(args.out, args.n_train, args.n_test, args.seed, args.chat)
    except ValueError as err:
        parser.error(str(err))
    for path in paths:
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
