"""Exercise 0.2, wrong: calls .strip() on anything: None raises AttributeError."""

EXERCISE = "0.2"


def parse_answer(completion, reverse: bool = True):
    text = completion.strip()
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text)
    if not digits or not all(c in "0123456789" for c in digits):
        return None
    return sign * int(digits[::-1] if reverse else digits)
