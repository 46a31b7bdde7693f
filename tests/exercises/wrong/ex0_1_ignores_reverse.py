"""Exercise 0.1, wrong: always reverses, whatever `reverse` says."""

EXERCISE = "0.1"


def format_answer(value: int, reverse: bool = True) -> str:
    return ("-" if value < 0 else "") + str(abs(value))[::-1]
