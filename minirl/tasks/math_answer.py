# Generated from notebooks/00_task_and_policy.py by tools/build.py -- edit the notebook, not this file.
"""A math-answer verifier for real models: the final number of a worked solution, in forward digits.

GSM8K's solutions end with `#### 62`; models trained on MATH write `\\boxed{62}`. `final_answer`
reads that number (after the last `####` or inside the last `\\boxed{}`, whichever comes last;
else a completion that is a number and nothing else), and `math_reward` compares it with the
row's `answer` column as a number: "1,234" equals 1234, "62.0" equals 62, "$5." equals 5.

Simplified on purpose: numbers only. No fractions, expressions or units, which a symbolic
checker such as math-verify (behind TRL's `accuracy_reward`) compares; GSM8K's answers are
integers, and a number is all a word-problem reward needs.
"""

__all__ = ["MAX_NUMBER_CHARS", "NUMBER", "parse_number", "final_answer", "reference_answer",
           "math_reward", "math_format_reward"]

import re
from fractions import Fraction

from minirl.tasks.arithmetic import completion_text

MAX_NUMBER_CHARS = 64  # longer "numbers" are malformed: no answer is that long, and Fraction() refuses
                       # strings of more than 4,300 digits (a verifier must not raise on them)
NUMBER = re.compile(r"(?P<sign>[+-]?)\s*\$?\s*(?P<sign2>[+-]?)\s*"                 # -$5 and $-5 alike
                    r"(?P<digits>[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
                    r"(?![0-9]|[.,][0-9])", re.ASCII)                                # a number ends here


def _number(match) -> Fraction | None:
    if match is None or (match["sign"] and match["sign2"]):
        return None
    value = Fraction(match["digits"].replace(",", ""))
    return -value if "-" in (match["sign"], match["sign2"]) else value


def parse_number(text) -> Fraction | None:
    """The number that `text` is, exactly, or None.

    Parses "62", " 62 ", "+62", "-5", "1,234" (commas only between groups of three), "$1,234.50",
    "62." (a sentence's period) and "62.0" (equal to 62); refuses "", "6 2", "1,23", "62 apples",
    "٣" (ASCII digits only) and anything over MAX_NUMBER_CHARS characters. Never raises.
    """
    if not isinstance(text, str) or len(text) > MAX_NUMBER_CHARS:
        return None
    text = text.strip().removesuffix(".").replace("\\$", "$").strip()
    return _number(NUMBER.fullmatch(text))


def _boxed(text: str) -> tuple[str, int] | None:
    """(content, index after its closing brace) of the last `\\boxed{...}`, braces matched; None if it never closes."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j], j + 1
    return None


def _latex_number(content: str) -> Fraction | None:
    """A number written in LaTeX: thin spaces (\\, \\!) and dollars dropped, {,} read as a thousands comma."""
    for old, new in (("{,}", ","), ("\\,", ""), ("\\!", ""), ("\\ ", ""), ("\\$", ""), ("$", "")):
        content = content.replace(old, new)
    return parse_number(content)


def final_answer(completion) -> Fraction | None:
    """The final number of a completion (a string or TRL's chat messages), or None.

    After the last `####`, the number that starts the rest ("#### 62" and "#### 62 apples"
    both give 62); inside the last `\\boxed{}`, the whole content must be a number. When both
    markers occur, the later one is the final answer. Without either, the completion must be
    a number and nothing else (" 62", "1,234."). Never raises.
    """
    text = completion_text(completion)
    if not isinstance(text, str):
        return None
    hashes, boxed = text.rfind("####"), text.rfind("\\boxed{")
    if hashes >= 0 and hashes > boxed:
        match = NUMBER.match(text[hashes + 4:].lstrip()[:MAX_NUMBER_CHARS])
        return _number(match) if match and match.end() < MAX_NUMBER_CHARS else None
    if boxed >= 0:
        found = _boxed(text)
        return _latex_number(found[0]) if found else None
    return parse_number(text)


def reference_answer(answer) -> Fraction | None:
    """A row's `answer` as a number: an int or float as it is, a string through `final_answer`
    (GSM8K's "...#### 62", "62", "\\boxed{62}"). None for anything else (a bool, NaN, "")."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return Fraction(answer)
    if isinstance(answer, float):
        return Fraction(repr(answer)) if answer == answer and abs(answer) != float("inf") else None
    return final_answer(answer) if isinstance(answer, str) else None


def math_reward(prompts, completions, answer, **columns) -> list[float]:
    """1.0 where a completion's final number equals the row's answer, else 0.0 (TRL signature).

    completions: list[str] or chat messages; answer: one per completion, a number or a
    GSM8K-style solution string. An answer that states no number is a ValueError naming it
    (a data set error: every completion of that prompt would score 0, silently).
    """
    if len(completions) != len(answer):
        raise ValueError(f"math_reward: {len(completions)} completions but {len(answer)} answers")
    rewards = []
    for completion, target in zip(completions, answer, strict=True):
        expected = reference_answer(target)
        if expected is None:
            raise ValueError(f"math_reward: answer {str(target)[:60]!r} states no number; give a number (62), "
                             "GSM8K's '... #### 62' or '\\boxed{62}'")
        rewards.append(1.0 if final_answer(completion) == expected else 0.0)
    return rewards


def math_format_reward(prompts, completions, **columns) -> list[float]:
    """1.0 where a completion ends with a marked number, `#### N` or `\\boxed{N}`, else 0.0; right or wrong.

    Whitespace, a period or a closing `$` may follow the marker; anything else after it scores 0.
    """
    rewards = []
    for completion in completions:
        text, ok = completion_text(completion), False
        if isinstance(text, str):
            hashes = text.rfind("####")
            if hashes >= 0 and hashes > text.rfind("\\boxed{"):
                ok = parse_number(text[hashes + 4:]) is not None
            else:
                found = _boxed(text)
                ok = found is not None and _latex_number(found[0]) is not None \
                    and not text[found[1]:].strip(" \t\n$.")
        rewards.append(1.0 if ok else 0.0)
    return rewards
