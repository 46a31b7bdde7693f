"""Exercise 0.1, wrong: goes through int(), so reversed zeros vanish: 100 -> "1"."""

EXERCISE = "0.1"


def format_answer(value: int, reverse: bool = True) -> str:
    digits = str(int(str(abs(value))[::-1])) if reverse else str(abs(value))
    return ("-" if value < 0 else "") + digits
