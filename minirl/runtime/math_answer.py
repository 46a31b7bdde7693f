"""A math-answer verifier for real models: the final answer of a worked solution, compared by value.

Hand-written: notebook 00 shows what it reads and scores; the reading itself is text parsing.

GSM8K's solutions end with `#### 62`; models trained on MATH write `\\boxed{62}` or `\\boxed{\\frac{3}{4}}`.
`final_answer` finds the final answer (after the last `####` that starts a number, or inside the last
`\\boxed{}`, whichever comes last) and reads it: a plain number exactly, as a `Fraction` ("1,234",
"−5", "$5."), without sympy; anything else with math-verify (units and text, percent, degrees,
`x = 62`, fractions). `math_reward` compares it with the row's `answer` column, read the same way:
two numbers exactly, anything else with math-verify's `verify` (numbers within 6 decimals).

Simplified on purpose, and where it differs from math-verify alone: a `####` line is read as GSM8K's
evaluation reads it (the number that starts it, words after it ignored); the last `\\boxed{}` is the
final answer (math-verify gathers every box into a set); a completion that is a number and nothing
else is its answer (math-verify wants it boxed or after "the answer is"). Off the main thread
math-verify runs without its timeouts (`minirl.runtime.latex_math`).
"""

__all__ = ["MAX_NUMBER_CHARS", "NUMBER", "parse_number", "MARKER", "MATH_AFTER", "final_answer",
           "PROSE", "LATEX_COMMAND", "reference_answer", "same_answer", "math_reward",
           "math_format_reward"]

import re
from fractions import Fraction

from minirl.runtime.completions import completion_text
from minirl.runtime.latex_math import parse_math, verify_math

MAX_NUMBER_CHARS = 64  # longer "numbers" are malformed: no answer is that long, and Fraction() refuses
                       # strings of more than 4,300 digits (a verifier must not raise on them)
NUMBER = re.compile(r"(?P<sign>[+\-−]?)\s*\$?\s*(?P<sign2>[+\-−]?)\s*"            # -$5 and $-5 alike
                    r"(?P<digits>[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)"
                    r"(?![0-9]|[.,][0-9])", re.ASCII)                                # a number ends here


def _number(match) -> Fraction | None:
    if match is None or (match["sign"] and match["sign2"]):
        return None
    value = Fraction(match["digits"].replace(",", ""))
    return -value if {match["sign"], match["sign2"]} & {"-", "−"} else value


def parse_number(text) -> Fraction | None:
    """The number that `text` is, exactly, or None.

    Parses "62", " 62 ", "+62", "-5", "−5" (a Unicode minus), "1,234" (commas only between groups of
    three), "$1,234.50", "62." (a sentence's period) and "62.0" (equal to 62); refuses "", "6 2",
    "1,23", "62 apples", "٣" (ASCII digits only) and anything over MAX_NUMBER_CHARS characters. Never raises.
    """
    if not isinstance(text, str) or len(text) > MAX_NUMBER_CHARS:
        return None
    text = text.strip().removesuffix(".").replace("\\$", "$").strip()
    return _number(NUMBER.fullmatch(text))


MARKER = re.compile(r"####[ \t]*(?=[-+−$.\\0-9])")     # "#### 62" marks an answer; "#### Verification" does not
MATH_AFTER = re.compile(r"[ \t]*[/^_\\{%°]")          # "#### 3/4", "#### 25%": math, not a number and words


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


def _read(math: str) -> Fraction | tuple | None:
    """An answer's text as a value: a Fraction if it is a plain number, else math-verify's reading of it boxed."""
    number = _latex_number(math)
    return number if number is not None else parse_math(f"\\boxed{{{math}}}") or None


def _marked(text: str) -> tuple[Fraction | tuple | None, bool]:
    """(value, True) of the final marked answer, the last `#### N` or `\\boxed{}`; (None, False) without one."""
    marks, boxed = [m.end() for m in MARKER.finditer(text)], text.rfind("\\boxed{")
    if marks and marks[-1] > boxed:
        line = text[marks[-1]:].split("\n", 1)[0]
        match = NUMBER.match(line[:MAX_NUMBER_CHARS])
        if match and match.end() < MAX_NUMBER_CHARS:         # GSM8K: the number that starts the line
            return (_read(line.strip()) if MATH_AFTER.match(line, match.end()) else _number(match)), True
        return (_read(line.strip()) if line.startswith(("\\", "$\\")) else None), True
    if boxed >= 0:
        found = _boxed(text)
        return (_read(found[0]) if found else None), True
    return None, False


def final_answer(completion) -> Fraction | tuple | None:
    """The final answer of a completion (a string or TRL's chat messages), or None. Never raises.

    A Fraction when the answer is a plain number (read without sympy), else math-verify's reading
    (a tuple: sympy value, matched text). Without a marker, the completion must be a number and
    nothing else (" 62", "1,234.", "$62$"), or state math after an anchor ("the answer is $62$").
    """
    text = completion_text(completion)
    if not isinstance(text, str):
        return None
    value, marked = _marked(text)
    if marked:
        return value
    number = _latex_number(text)
    if number is not None or ("$" not in text and "\\" not in text):
        return number
    return parse_math(text) or None


PROSE = re.compile(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}")      # two words outside LaTeX commands: prose, not math
LATEX_COMMAND = re.compile(r"\\[A-Za-z]+(?:\{[^{}]*\})?")


def reference_answer(answer) -> Fraction | tuple | None:
    """A row's `answer` as a value: an int or float as it is; a string with a marker as `final_answer`
    reads it (GSM8K's "...#### 62"); else the whole string as a number or as boxed math ("\\frac{3}{4}",
    "\\text{(C)}"). None for anything else: a bool, NaN, "", prose ("see solution")."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return Fraction(answer)
    if isinstance(answer, float):
        return Fraction(repr(answer)) if answer == answer and abs(answer) != float("inf") else None
    if not isinstance(answer, str):
        return None
    value, marked = _marked(answer)
    if marked or PROSE.search(LATEX_COMMAND.sub("", answer)):
        return value
    return _read(answer.strip()) if answer.strip() else None


def same_answer(expected, found) -> bool:
    """Whether a final answer equals the expected one: two Fractions exactly, else math-verify's verify."""
    if found is None:
        return False
    if isinstance(expected, Fraction) and isinstance(found, Fraction):
        return expected == found
    return verify_math(expected, found)


def math_reward(prompts, completions, answer, **columns) -> list[float]:
    """1.0 where a completion's final answer equals the row's answer, else 0.0 (TRL signature).

    completions: list[str] or chat messages; answer: one per completion, a number, a GSM8K-style
    solution string or LaTeX. An answer that cannot be read is a ValueError naming the row by its
    prompt (a data set error: every completion of that prompt would score 0, silently).
    """
    if len(completions) != len(answer):
        raise ValueError(f"math_reward: {len(completions)} completions but {len(answer)} answers")
    rewards = []
    for i, (completion, target) in enumerate(zip(completions, answer, strict=True)):
        expected = reference_answer(target)
        if expected is None:
            prompt = completion_text(prompts[i]) if prompts is not None and i < len(prompts) else None
            row = f"the row with prompt {prompt[:40]!r}" if prompt else f"answer {i}"
            raise ValueError(f"math_reward: {row} has the answer {str(target)[:40]!r}, which states no number or "
                             "math (give a number, GSM8K's '... #### 62' or LaTeX such as '\\frac{3}{4}')")
        rewards.append(1.0 if same_answer(expected, final_answer(completion)) else 0.0)
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
