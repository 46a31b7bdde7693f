"""The page notebook 02's diagnosis prints: the report of the four steps, the bucket table, the worst tokens.

Hand-written (table formatting). `diagnose_mismatch` (notebook 02) fills a `MismatchReport`; its `str`
is a page a learner can read, its `to_dict` what the chapter writes to summary.json.
"""

import math
from dataclasses import dataclass, field


def format_buckets(rows: list[dict]) -> str:
    """The rows of `probability_buckets` as a fixed-width table."""
    lines = [f"{'rollout p':>17} | {'tokens':>6} | {'mean |dlogp|':>12} | {'max |dlogp|':>11} | ratio outside"]
    for r in rows:
        lines.append(f"[{r['lo']:<6.3g}, {r['hi']:>6.3g}) | {r['tokens']:>6} | {r['mean_abs_delta']:>12.2e} | "
                     f"{r['max_abs_delta']:>11.2e} | {r['share_outside']:>8.1%}")
    return "\n".join(lines)


def worst_tokens(pair, tokenizer=None, k: int = 3) -> list[dict]:
    """The k sampled tokens of a `LogprobPair` with the largest |delta log p|: position [b, c], token, both p."""
    delta = (pair.trainer_logps - pair.behavior_logps).abs().masked_fill(~pair.mask.bool(), -1.0)
    top = delta.flatten().topk(min(k, int(pair.mask.sum()))).indices
    rows = []
    for flat in top.tolist():
        b, c = divmod(flat, delta.shape[1])
        tid = int(pair.completion_ids[b, c])
        rows.append(dict(position=[b, c], token=tokenizer.decode([tid]) if tokenizer else tid,
                         p_rollout=math.exp(pair.behavior_logps[b, c].item()),
                         p_trainer=math.exp(pair.trainer_logps[b, c].item())))
    return rows


@dataclass
class MismatchReport:
    """What `diagnose_mismatch` found, step by step; print it."""

    rollout_dtype: str
    train_dtype: str
    sync_problems: list[str]
    stats: dict[str, float]
    buckets: list[dict]
    worst_tokens: list[dict]
    sweep: dict[str, dict[str, float]] = field(default_factory=dict)
    routes: dict[str, float] | None = None

    def __str__(self) -> str:
        s = self.stats
        out = [f"Mismatch report: rollout {self.rollout_dtype} (KV cache) vs trainer {self.train_dtype} (full forward)",
               "1. version and synchronization: " + ("OK" if not self.sync_problems else "PROBLEMS"),
               *[f"   - {p}" for p in self.sync_problems],
               f"2. token by token ({s['tokens']} tokens): mean |dlogp| {s['mean_abs_delta']:.2e}, "
               f"max {s['max_abs_delta']:.2e}, KL(k3) {s['kl_k3']:.2e},",
               f"   ratio in [{s['ratio_min']:.3f}, {s['ratio_max']:.3f}], outside [0.8, 1.25]: "
               f"{s['share_outside']:.2%}",
               *["   " + line for line in format_buckets(self.buckets).splitlines()],
               "   worst tokens:",
               *[f"     {w['token']!r} at {w['position']}: p_rollout {w['p_rollout']:.3g}, "
                 f"p_trainer {w['p_trainer']:.3g}" for w in self.worst_tokens]]
        out.append("3. precision sweep (rollout dtype vs trainer " + self.train_dtype + "):")
        out.append(f"   {'rollout':>14} | {'mean |dlogp|':>12} | {'max |dlogp|':>11} | ratio outside [0.8, 1.25]")
        for dtype, st in self.sweep.items():
            out.append(f"   {dtype:>14} | {st['mean_abs_delta']:>12.2e} | {st['max_abs_delta']:>11.2e} | "
                       f"{st['share_outside']:.2%}")
        if self.routes is None:
            out.append("4. MoE routes: not a mixture-of-experts policy (nothing to compare)")
        else:
            out.append("4. MoE routes: " + ", ".join(f"{k} {v:.4g}" for k, v in self.routes.items()))
        return "\n".join(out)

    def to_dict(self) -> dict:
        return dict(rollout_dtype=self.rollout_dtype, train_dtype=self.train_dtype,
                    sync_problems=self.sync_problems, stats=self.stats, buckets=self.buckets,
                    worst_tokens=self.worst_tokens, sweep=self.sweep, routes=self.routes)
