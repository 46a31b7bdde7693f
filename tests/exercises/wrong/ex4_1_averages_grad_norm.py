"""Exercise 4.1, wrong: averages the gradient norm (and counts a bool as a number): rank 0's norm is already global."""

EXERCISE = "4.1"


def reduce_metrics(records, tokens, loss_weights=None):
    if len(records) == 1:
        return dict(records[0])
    total = sum(tokens) or 1.0
    out = {}
    for key, value in records[0].items():
        values = [r.get(key) for r in records]
        if not all(isinstance(v, (int, float)) for v in values):
            out[key] = value
        elif key.endswith("/min"):
            out[key] = min(values)
        elif key.endswith(("/max", "skipped")):
            out[key] = max(values)
        elif key in ("loss", "value_loss") and loss_weights is not None:
            out[key] = sum(w * v for w, v in zip(loss_weights, values, strict=True)) / len(records)
        else:
            out[key] = sum(v * t for v, t in zip(values, tokens, strict=True)) / total
    return out
