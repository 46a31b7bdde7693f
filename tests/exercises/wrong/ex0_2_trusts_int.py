"""Exercise 0.2, wrong: lets int() decide what a number is: it accepts "٣", "1_0" and " 1" after a sign."""

EXERCISE = "0.2"


def parse_answer(completion, reverse: bool = True):
    if not isinstance(completion, str):
        return None
    text = completion.strip()
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text)
    try:
        return sign * int(digits[::-1] if reverse else digits)
    except ValueError:
        return None
