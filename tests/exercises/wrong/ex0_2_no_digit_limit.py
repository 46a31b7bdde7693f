"""Exercise 0.2, wrong: no MAX_DIGITS limit: int() raises on a completion of more than 4,300 digits."""

EXERCISE = "0.2"


def parse_answer(completion, reverse: bool = True):
    if not isinstance(completion, str):
        return None
    text = completion.strip()
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text)
    if not digits or not all(c in "0123456789" for c in digits):
        return None
    return sign * int(digits[::-1] if reverse else digits)
