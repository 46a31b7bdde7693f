"""Exercise 4.1, wrong: averages every number plainly over the ranks, ignoring how many tokens each holds."""

EXERCISE = "4.1"


def reduce_metrics(records, tokens, loss_weights=None):
    if len(records) == 1:
        return dict(records[0])
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
        elif key in ("loss", "value_loss") and loss_weights is not None:
            out[key] = sum(w * v for w, v in zip(loss_weights, values, strict=True)) / len(records)
        else:
            out[key] = sum(values) / len(values)
    return out
