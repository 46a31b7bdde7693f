"""The errors and argument checks of notebook 08's modules: routers, pipelines, packing.

Hand-written (validation; the lessons are the balancing router of `minirl.models.moe_balance`, the
schedules of `minirl.parallel.pipeline` and the packers of `minirl.parallel.packing`, which call these).
It imports nothing heavy (no torch), so a script can check its arguments before torch loads.
Each error names the setting that is wrong and what to do instead, so that bad input fails here with a
sentence rather than deep inside a collective, a scheduler or a tensor operation.

- `RouterError` / `check_router_logits`: a router whose scores hold NaN or inf cannot choose experts.
- `PipelineError` / `check_pipeline`: stage and micro-batch counts that cannot split a batch or the layers.
- `check_orders`: a schedule (rank -> ordered ops, a tuple being an overlapped pair) in which every stage
  lives on one rank and every micro-batch has one forward and either one full backward (B) or its two
  halves (I, W) at every stage; returns the number of stages.
- `PackingError` / `check_lengths`: a sequence that cannot go into a pack of the given token budget.
"""


class RouterError(FloatingPointError):
    """A router produced non-finite scores: the layer cannot choose experts."""


def check_router_logits(logits, layer: str = "router") -> None:
    """Raise RouterError when router logits (a [N, E] tensor) hold NaN or inf (usually an overflow upstream)."""
    finite = logits.isfinite()
    if not finite.all():
        bad = (~finite).any(-1).sum().item()
        raise RouterError(f"{layer}: router logits are not finite for {bad} of {logits.shape[0]} tokens; "
                          "look for an overflow before this layer (lower the learning rate, clip gradients, or "
                          "compute the router in float32)")


class PipelineError(ValueError):
    """A pipeline that cannot be built or scheduled; the message names the setting and the fix."""


def check_pipeline(num_stages: int, num_microbatches: int, num_samples: int | None = None,
                   num_layers: int | None = None) -> None:
    """Raise PipelineError for a pipeline that cannot be split as asked."""
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PipelineError(f"{name}={value!r}: must be an int >= 1")
    if num_samples is not None and num_microbatches > num_samples:
        raise PipelineError(f"num_microbatches={num_microbatches} exceeds the batch's {num_samples} samples: "
                            f"every micro-batch needs at least one sample; use num_microbatches <= {num_samples}")
    if num_layers is not None and num_layers % num_stages:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise PipelineError(f"num_stages={num_stages} does not divide num_layers={num_layers}: stages would be "
                            f"unequal and the slowest sets the pace; use one of {divisors}")


def ops_of(actions):
    """The ops of one rank's actions, an overlapped pair (a tuple) giving both of its ops."""
    for action in actions:
        yield from (action if isinstance(action, tuple) else (action,))


def check_orders(orders: dict[int, list]) -> int:
    """Raise PipelineError unless `orders` is a complete schedule; returns its number of stages.

    A stage lives on one rank; every op is of a kind F, B, I or W and appears once; every
    micro-batch has, at every stage, one forward and either one B or one I plus one W.
    """
    kinds = ("F", "B", "I", "W")
    stage_rank, seen = {}, {}
    for rank, actions in orders.items():
        for op in ops_of(actions):
            if stage_rank.setdefault(op.stage, rank) != rank:
                raise PipelineError(f"stage {op.stage} appears on ranks {stage_rank[op.stage]} and {rank}: "
                                    "a stage lives on one rank")
            if op.kind not in kinds:
                raise PipelineError(f"op kind {op.kind!r}: use one of {kinds}")
            key = (op.kind, op.microbatch, op.stage)
            seen[key] = seen.get(key, 0) + 1
    repeated = [k for k, n in seen.items() if n > 1]
    if repeated:
        raise PipelineError(f"ops scheduled twice: {repeated[:3]}")
    num_stages = max(stage_rank) + 1
    for m in {m for _, m, _ in seen}:
        for s in range(num_stages):
            full = ("B", m, s) in seen
            split = ("I", m, s) in seen and ("W", m, s) in seen
            if ("F", m, s) not in seen or full == split:
                raise PipelineError(f"micro-batch {m} at stage {s} needs one forward and either one B or one "
                                    "I plus one W")
    return num_stages


class PackingError(ValueError):
    """A sequence that cannot be packed as asked; the message names it and the fix."""


def check_lengths(lengths: list[int], budget: int) -> None:
    """Raise PackingError unless every length is an int in 1..budget."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise PackingError(f"budget={budget!r}: must be an int >= 1 (tokens per pack)")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PackingError(f"lengths[{i}]={n!r}: every sequence needs at least one token")
        if n > budget:
            raise PackingError(f"lengths[{i}]={n} is longer than the pack budget={budget}: raise the budget to at "
                               f"least {max(lengths)}, or cap generation (max_completion_length) below it")
