"""math-verify's `parse` and `verify`, callable from any thread (hand-written plumbing for `runtime/math_answer`).

math-verify (what TRL's `accuracy_reward` grades with) bounds each parse and comparison with
`signal.alarm`, which Python allows only in the main thread: from chapter 07's producer threads, or a
Ray actor that runs methods in a thread pool, it raises ValueError. As TRL does, the timeouts hold in
the main thread (10 s to parse, 5 s to compare) and are off in any other, where a pathological
expression could hold its thread; the text handed over is cut to MAX_LATEX_CHARS to keep sympy's
work small. math-verify and sympy load on the first LaTeX answer (about a second), not on import.
"""

from __future__ import annotations

import functools
import logging
import threading
from fractions import Fraction

MAX_LATEX_CHARS = 4000          # a completion's tail; a boxed answer is far shorter
PARSE_TIMEOUT, VERIFY_TIMEOUT = 10, 5  # seconds, main thread only (TRL's accuracy_reward: the same)


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning: off the main thread it is disabled on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _math_verify():
    """The math_verify module and the two extraction settings, loaded once."""
    import math_verify
    from math_verify import LatexExtractionConfig
    from math_verify.parser import NormalizationConfig

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_NoTimeoutNotice())
    # a completion: LaTeX only, \boxed{} first, math outside a box only after an anchor ("the final
    # answer is $...$"), as TRL's accuracy_reward reads a completion; units such as \text{ dollars} dropped
    answer = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                    try_extract_without_anchor=False)]
    return math_verify, answer


def _timeout(seconds: int) -> int | None:
    return seconds if threading.current_thread() is threading.main_thread() else None


def parse_math(text: str, anchored: bool = True) -> tuple:
    """math-verify's reading of `text`: (sympy value, the matched string, ...), or () when it finds none.

    anchored=True: read as a completion (see `_math_verify`); anchored=False: math-verify's default
    reading, LaTeX or a plain expression anywhere (a prose answer such as "The answer is 62").
    Only the last MAX_LATEX_CHARS characters are read. Never raises. Short texts are cached: a
    prompt's answer comes G times per step, and a boxed answer often repeats within a group.
    """
    return _parse_short(text, anchored) if len(text) <= 256 else _parse(text, anchored)


@functools.lru_cache(maxsize=16384)
def _parse_short(text: str, anchored: bool) -> tuple:
    return _parse(text, anchored)


def _parse(text: str, anchored: bool) -> tuple:
    math_verify, answer = _math_verify()
    text = text[-MAX_LATEX_CHARS:].replace("°", "^\\circ")        # 62° as LaTeX writes it: 62^\circ
    kwargs = {"extraction_config": answer, "extraction_mode": "first_match"} if anchored else {}
    try:
        return tuple(math_verify.parse(text, parsing_timeout=_timeout(PARSE_TIMEOUT), **kwargs))
    except Exception:                      # math-verify catches its own errors; anything else is no answer
        return ()


def _sympy(value):
    """A Fraction as a sympy Rational (math-verify compares sympy objects); a parse as a list."""
    if isinstance(value, Fraction):
        import sympy
        return sympy.Rational(value.numerator, value.denominator)
    return list(value)


def verify_math(expected, found) -> bool:
    """math-verify's `verify(gold, target)`: True if any reading of `found` equals one of `expected`.

    Each side is a Fraction or a `parse_math` tuple. Numbers compare within 6 decimals, 25\\% equals
    25 and 0.25, x = 62 equals 62, sets and intervals as sets. Never raises.
    """
    math_verify, _ = _math_verify()
    try:
        return bool(math_verify.verify(_sympy(expected), _sympy(found), timeout_seconds=_timeout(VERIFY_TIMEOUT)))
    except Exception:
        return False
