"""Exercise 2.2, wrong: takes delta = behavior - trainer: the ratio is inverted."""

EXERCISE = "2.2"


def probability_buckets(trainer_logps, behavior_logps, mask, edges=(0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0),
                        low=0.8, high=1.25):
    valid = mask.bool()
    p = behavior_logps.double()[valid].exp().clamp(max=1.0)
    delta = (behavior_logps.double() - trainer_logps.double())[valid]
    ratio = delta.exp()
    rows = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        last = i == len(edges) - 2
        inside = (p >= lo) & ((p <= hi) if last else (p < hi))
        d, r = delta[inside].abs(), ratio[inside]
        n = int(inside.sum())
        rows.append(dict(lo=float(lo), hi=float(hi), tokens=n,
                         mean_abs_delta=d.mean().item() if n else 0.0,
                         max_abs_delta=d.max().item() if n else 0.0,
                         share_outside=((r < low) | (r > high)).double().mean().item() if n else 0.0))
    return rows
