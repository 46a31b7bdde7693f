"""What the model wrote: a few prompts, completions and rewards per logged step, in OUT/completions.jsonl and on screen.

Hand-written (it teaches nothing). TRL's `log_completions`, as the training chapters run it:
- `SampleTap`, a run callback that `run_in_dir` puts first: during each step it keeps what the
  engine generated and what each reward function returned (it wraps `state.engine.generate` and
  `state.reward_funcs` for the run and gives them back at its end; stage 7's trainer keeps its
  batch of trajectories instead, `AsyncState.last_batch`), and adds TRL's
  `completions/clipped_ratio` to the step's record: the share of completions cut at
  `max_completion_length` (that reached it without ending in EOS).
- `CompletionLog`, with `log_completions` N > 0 and a run directory: N rows (distinct prompts first)
  of the first `FIRST_STEPS` steps and of every step with an evaluation, and N held-out rows of
  every evaluation, appended to `completions.jsonl` (one JSON object per row: step, phase
  train|eval, prompt, completion, rewards {function: value, null where it does not apply or
  failed}, total: the weighted sum) and printed as a small table (at most 100 columns, text cut).
- `eval_metrics(eval_fn)`: the held-out evaluation's mean weighted reward and each reward
  function's mean under TRL's names (`eval/reward`, `eval/rewards/<name>/mean`), for its record.
  `log_eval` logs an evaluation made outside the run loop (chapter 07's snapshots).

RLConfig's `log_completions` is 0 (TRL's False): a notebook's run logs nothing; the chapters'
`--log-completions` defaults to 4 (`minirl.runtime.training_cli.LOG_COMPLETIONS`).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
import sys
from pathlib import Path

from minirl.train.run import Callback

FILE = "completions.jsonl"
FIRST_STEPS = 3                 # every step up to this one logs its rows
WIDTH = 100                     # the printed table's columns at most


class SampleTap(Callback):
    """Keeps what the last step generated and how each reward function scored it (`rows(state)`, after it)."""

    def __init__(self, eos_token_id: int | None = None):
        self.rollouts, self.calls, self.capturing = [], {}, False
        self.eos, self._engine, self._funcs = eos_token_id, None, None

    def around(self, step_fn):
        """`step_fn`, with the engine's and the reward functions' outputs kept while it runs (not an evaluation's)."""
        def step(state):
            self.rollouts, self.calls, self.capturing = [], {}, True
            try:
                return step_fn(state)
            finally:
                self.capturing = False
        return step

    def on_start(self, state):
        original = getattr(state.engine, "generate", None)
        if callable(original):
            def generate(*args, **kwargs):              # its name: a profile's "generate" stage (profile_tables)
                rollout = original(*args, **kwargs)
                if self.capturing:
                    self.rollouts.append(rollout)
                return rollout
            try:
                state.engine.generate = generate
                self._engine = state.engine
            except (AttributeError, TypeError):        # an engine that takes no attributes: no clipped share, no text
                pass
        self._funcs = state.reward_funcs
        state.reward_funcs = [self._wrap(i, f) for i, f in enumerate(state.reward_funcs or [])]

    def on_step(self, state, record):
        cap = state.config.sampling.max_completion_length
        batch = getattr(state, "last_batch", None)     # stage 7: the trajectories the trainer took
        rollouts = [t.rollout for t in batch] if batch else self.rollouts
        clipped = [flag for r in rollouts for flag in clipped_flags(r, cap, self.eos)]
        if clipped:
            record["completions/clipped_ratio"] = sum(clipped) / len(clipped)

    def on_end(self, state):
        if self._engine is not None:
            vars(self._engine).pop("generate", None)
        if self._funcs is not None:
            state.reward_funcs = self._funcs

    def _wrap(self, index: int, func):
        """`func` under its own name and signature (async stays async), its outputs kept while a step runs."""
        def keep(args, kwargs, out):
            if self.capturing:
                prompts = kwargs.get("prompts", args[0] if args else None)
                completions = kwargs.get("completions", args[1] if len(args) > 1 else None)
                self.calls.setdefault(index, []).append((prompts, completions, out))
            return out

        if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__):
            async def tapped(*args, **kwargs):
                return keep(args, kwargs, await func(*args, **kwargs))
        else:
            def tapped(*args, **kwargs):
                return keep(args, kwargs, func(*args, **kwargs))
        functools.update_wrapper(tapped, func)
        tapped.__name__ = getattr(func, "__name__", type(func).__name__)     # reward_name's rule
        tapped.__wrapped__ = func                      # inspect.signature (TRL's extras are passed as func takes them)
        return tapped

    def rows(self, state) -> list[dict]:
        """The last step's rows: each prompt and completion as the reward functions saw them (else as generated),
        each function's value (None: not applicable, or not kept) and the weighted total of the values there are."""
        batch = getattr(state, "last_batch", None)
        if batch:
            return trajectory_rows(batch)
        funcs = self._funcs or []
        names = [getattr(f, "__name__", type(f).__name__) for f in funcs]
        weights = list(state.reward_weights or [1.0] * len(funcs))
        generated = [(p, c) for r in self.rollouts for p, c in zip(r.prompts, r.completions, strict=True)]
        n = len(generated) or max((len(c) for calls in self.calls.values() for _, c, _ in calls if c), default=0)
        seen = [(p, c) for calls in self.calls.values() for p, c, _ in calls if c is not None and len(c) == n]
        texts = list(zip(*seen[0], strict=True)) if seen and len(seen[0][0]) == n else generated
        columns = [_aligned(self.calls.get(i, []), n) for i in range(len(funcs))]
        rows = []
        for j, (prompt, completion) in enumerate(texts):
            rewards = {name: column[j] for name, column in zip(names, columns, strict=True)}
            values = [w * v for w, v in zip(weights, rewards.values(), strict=True) if v is not None]
            rows.append({"prompt": _text(prompt), "completion": _text(completion), "rewards": rewards,
                         "total": sum(values) if values else None})
        return rows


def clipped_flags(rollout, cap: int, eos: int | None) -> list[bool]:
    """Per completion: did it reach `cap` tokens without ending in EOS (TRL's clipped; unknown EOS: reached `cap`)."""
    lengths = rollout.completion_mask.sum(1)
    last = rollout.completion_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    ended = (last == eos) if eos is not None else (lengths < 0)
    return ((lengths >= cap) & ~ended).tolist()


def _aligned(calls: list, n: int) -> list:
    """One function's values for the step's n completions: a call on all n, else its calls one after the other
    (the sample-by-sample retry of --reward-errors zero) when they add up to n, else None for each."""
    whole = [out for _, completions, out in calls if completions is not None and len(completions) == n]
    if whole:
        return [_number(v) for v in list(whole[0])]
    parts = [_number(v) for _, _, out in calls for v in list(out)]
    return parts if len(parts) == n else [None] * n


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _text(value) -> str:
    """A prompt or completion as text: a string, a chat's messages joined as "role: content" (one message: its
    content)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        return str(value[0].get("content", ""))
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in value)
    return str(value)


def trajectory_rows(trajectories: list) -> list[dict]:
    """Rows of stage 7's trajectories (in ticket order, as the trainer's batch): their prompts, completions,
    each reward function's value (`scores`) and the environment's reward."""
    rows = []
    for t in sorted(trajectories, key=lambda t: t.ticket):
        for j in range(len(t.rewards)):
            rows.append({"prompt": _text(t.rollout.prompts[j]), "completion": _text(t.rollout.completions[j]),
                         "rewards": {name: _number(values[j]) for name, values in t.scores.items()},
                         "total": float(t.rewards[j])})
    return rows


def pick(rows: list[dict], n: int, num_generations: int) -> list[dict]:
    """n rows, distinct prompts first: the first completion of each group, then the second, ..."""
    g = max(1, num_generations)
    groups = max(1, len(rows) // g)
    order = [b * g + k for k in range(g) for b in range(groups) if b * g + k < len(rows)]
    return [rows[i] for i in order[:n]]


def eval_metrics(eval_fn) -> dict:
    """{"eval/reward": mean weighted reward, "eval/rewards/<name>/mean": each function's mean} of the last call of
    `eval_fn` (a Task's `HeldOut`); {} for an evaluation that keeps no result."""
    last = getattr(eval_fn, "last", None) or {}
    out = {"eval/reward": last["reward"]} if "reward" in last else {}
    return out | {f"eval/{k}/mean": v for k, v in last.items() if k.startswith("rewards/")}


def eval_rows(eval_fn, n: int) -> list[dict]:
    """The first n held-out rows of the last evaluation (prompt, completion, rewards, total); [] if none kept."""
    return list((getattr(eval_fn, "last", None) or {}).get("samples", []))[:n]


class CompletionLog(Callback):
    """Appends the logged steps' rows to `path` and prints them (see the module docstring)."""

    def __init__(self, path, n: int, tap: SampleTap, eval_fn=None, echo: bool = True):
        self.path, self.n, self.tap, self.eval_fn, self.echo = Path(path), n, tap, eval_fn, echo

    def on_start(self, state):
        if self.path.exists():                 # a resume: rows after its checkpoint are the stopped run's
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= state.step]
            self.path.write_text("".join(f"{line}\n" for line in kept))
        if state.step == 0 and state.metrics and "accuracy" in state.metrics[-1]:
            self.write(0, "eval", eval_rows(self.eval_fn, self.n))

    def on_step(self, state, record):
        evaluated = "accuracy" in record
        if state.step <= FIRST_STEPS or evaluated:
            self.write(state.step, "train", pick(self.tap.rows(state), self.n, state.config.sampling.num_generations))
        if evaluated:
            self.write(state.step, "eval", eval_rows(self.eval_fn, self.n))

    def write(self, step: int, phase: str, rows: list[dict]) -> None:
        write_rows(self.path, step, phase, rows, self.echo)


def write_rows(path, step: int, phase: str, rows: list[dict], echo: bool = True) -> None:
    """Append rows to the completions file (with their step and phase) and print them as a table."""
    if not rows:
        return
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps({"step": step, "phase": phase, **row}) + "\n")
    if echo:
        from tqdm.auto import tqdm  # noqa: PLC0415 (a progress bar may be on screen)

        tqdm.write(table(rows, f"step {step}, {phase}: {len(rows)} completions ({Path(path).name})"), file=sys.stdout)


def log_eval(out_dir, step: int, eval_fn, n: int, echo: bool = True) -> None:
    """Log the held-out rows of `eval_fn`'s last call as step `step`'s evaluation (nothing when n is 0)."""
    if n and out_dir is not None:
        write_rows(Path(out_dir) / FILE, step, "eval", eval_rows(eval_fn, n), echo)


def table(rows: list[dict], title: str, width: int = WIDTH) -> str:
    """rows as a text table at most `width` columns wide: prompt (its end), completion, each reward, total."""
    names = list(dict.fromkeys(k for r in rows for k in r["rewards"]))
    cell = 7                                           # " -0.50 " per reward; as many as leave room for the text
    shown = names[:max(0, (width - 7 - 40) // (cell + 1))]
    text = width - (cell + 1) * (len(shown) + 1) - 5   # separators: " | ", " |"
    p_width, c_width = text * 2 // 5, text - text * 2 // 5

    def flat(s):                                       # a chat template's markers are noise at this width
        s = " ".join(re.sub(r"<\|[^|<>]*\|>", " ", s or "").split()) if "<|" in (s or "") else (s or "")
        return s.removesuffix(" assistant").replace("\n", "⏎")

    def fit(s, n, tail=False):
        s = flat(s)
        return s.ljust(n) if len(s) <= n else ("…" + s[-(n - 1):] if tail else s[:n - 1] + "…")

    def num(v):
        if v is None:
            return "-".rjust(cell)
        text = next(t for t in (f"{v:.2f}", f"{v:.0f}", f"{v:.1e}", "?" * cell) if len(t) <= cell)
        return text.rjust(cell)

    head = f"{'prompt'.ljust(p_width)} | {'completion'.ljust(c_width)} |" + "".join(
        f" {n[:cell].rjust(cell)}" for n in shown) + f" {'total':>{cell}}"
    lines = [title[:width], head[:width]]
    for r in rows:
        line = (f"{fit(r['prompt'], p_width, tail=True)} | {fit(r['completion'], c_width)} |"
                + "".join(f" {num(r['rewards'].get(n))}" for n in shown) + f" {num(r['total'])}")
        lines.append(line[:width])
    return "\n".join(lines)
