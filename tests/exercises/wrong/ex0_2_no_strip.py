"""Exercise 0.2, wrong: does not strip whitespace: " 26\n" is malformed."""

EXERCISE = "0.2"


def parse_answer(completion, reverse: bool = True):
    if not isinstance(completion, str):
        return None
    sign, digits = (-1, completion[1:]) if completion.startswith("-") else (1, completion)
    if not digits or not all(c in "0123456789" for c in digits):
        return None
    return sign * int(digits[::-1] if reverse else digits)
