"""Exercise 0.1, wrong: reverse=False writes abs(value): the sign is lost."""

EXERCISE = "0.1"


def format_answer(value: int, reverse: bool = True) -> str:
    digits = str(abs(value))
    return ("-" if value < 0 else "") + digits[::-1] if reverse else digits
