"""Exercise 0.2, wrong: uses str.isdigit, which is true for "²" and "٣" (int("²") then raises)."""

EXERCISE = "0.2"


def parse_answer(completion, reverse: bool = True):
    if not isinstance(completion, str):
        return None
    text = completion.strip()
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text)
    if not digits.isdigit():
        return None
    return sign * int(digits[::-1] if reverse else digits)
