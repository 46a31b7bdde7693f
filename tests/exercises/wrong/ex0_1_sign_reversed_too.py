"""Exercise 0.1, wrong: reverses the whole string, so the minus sign ends up last: -12 -> "21-"."""

EXERCISE = "0.1"


def format_answer(value: int, reverse: bool = True) -> str:
    return str(value)[::-1] if reverse else str(value)
