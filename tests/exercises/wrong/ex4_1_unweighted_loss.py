"""Exercise 4.1, wrong: reduces the loss like any other mean, ignoring the ranks' loss weights."""

EXERCISE = "4.1"


def reduce_metrics(records, tokens, loss_weights=None):
    if len(records) == 1:
        return dict(records[0])
    total = sum(tokens) or 1.0
    out = {}
    for key, value in records[0].items():
        values = [r.get(key) for r in records]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = value
        elif key.endswith("/min"):
            out[key] = min(values)
        elif key.endswith(("/max", "skipped")):
            out[key] = max(values)
        elif key.endswith("grad_norm"):
            out[key] = value
        else:
            out[key] = sum(v * t for v, t in zip(values, tokens, strict=True)) / total
    return out
