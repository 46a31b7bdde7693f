"""A task: the rows a run trains on, the rows it is judged on, and the rewards that score them.

Hand-written: notebook 00 shows it in use; it is the interface every chapter trains through, not a lesson.

Every chapter trains a `Task`: the embedded arithmetic task is one (`arithmetic_task`), a data
set file with named rewards is another (`minirl.runtime.task_files.load_task`, what `--dataset`,
`--eval-dataset`, `--reward` and `--reward-weights` build). `Task.evaluate` decodes the
held-out prompts greedily and scores them with the task's rewards.

Simplified vs TRL: evaluation decodes each held-out prompt once, greedily (TRL samples
`num_generations_eval` completions with the training sampler's settings).
"""

import math
from dataclasses import dataclass, field

import torch

from minirl.tasks.arithmetic import TaskConfig, arithmetic_reward, make_task
from minirl.tasks.rewards import call_reward, combine_rewards, reward_name


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 500,
                       ids: list | None = None) -> list[str]:
    """Greedy completions of text prompts, in order, decoded without special tokens.

    Prompts are tokenized as they are (no special tokens added: a chat template has already
    put its own), left-padded in batches of `batch_size`; generation stops at EOS. ids: a list
    that receives each completion's token ids up to and including its EOS (TRL's completion_ids).
    """
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"                # every prompt ends at the same column
    device = next(model.parameters()).device
    texts = []
    try:
        for start in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for row in out[:, enc["input_ids"].shape[1]:].tolist() if ids is not None else ():
                ids.append(row[:row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row)
    finally:
        model.train(was_training)
        tokenizer.padding_side = side
    return texts


@dataclass
class Task:
    """What a run trains on and how it is judged.

    train, test: rows {"prompt": text, **columns}; prompts are text (a conversation has been
    through the chat template), the other columns reach the rewards. test may be empty (no
    evaluation). reward_funcs: TRL-style f(prompts, completions, **columns); reward_weights:
    one float each (TRL's `reward_weights`, default 1.0). accuracy_reward: the name of a 0/1
    correctness reward, whose mean is the task's accuracy (None: there is none, and a run
    reports the mean weighted reward). max_new_tokens: evaluation's length (None: the caller's).
    """

    name: str
    train: list[dict]
    test: list[dict]
    reward_funcs: list
    reward_weights: list[float] = field(default_factory=list)
    accuracy_reward: str | None = None
    max_new_tokens: int | None = None

    def __post_init__(self):
        self.reward_weights = list(self.reward_weights) or [1.0] * len(self.reward_funcs)
        if len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"Task {self.name}: {len(self.reward_weights)} reward_weights for "
                             f"{len(self.reward_funcs)} reward_funcs; give one weight per function")
        if self.accuracy_reward is not None and self.accuracy_reward not in self.reward_names:
            raise ValueError(f"Task {self.name}: accuracy_reward={self.accuracy_reward!r} is none of the reward "
                             f"functions ({', '.join(self.reward_names)})")

    @property
    def reward_names(self) -> list[str]:
        return [reward_name(f) for f in self.reward_funcs]

    def score(self, rows: list[dict], completions: list, **extras) -> tuple[torch.Tensor, dict]:
        """(weighted total [N], {"rewards/<name>": mean}) for one completion per row, in float64.
        extras: TRL's (`minirl.tasks.rewards.TRL_EXTRAS`) that the caller has, passed to the functions."""
        return combine_rewards(self.rewards_per_func(rows, completions, **extras), self.reward_weights,
                               self.reward_names)

    def rewards_per_func(self, rows: list[dict], completions: list, **extras) -> torch.Tensor:
        """[N, F] float64: each reward function's value for one completion per row (None, "does not apply": NaN)."""
        columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
        prompts = [r["prompt"] for r in rows]
        return torch.tensor([[math.nan if v is None else v for v in call_reward(f, prompts, completions, columns,
                                                                                **extras)]
                             for f in self.reward_funcs], dtype=torch.float64).T          # [N, F]; None: NaN

    def evaluate(self, model, tokenizer, max_new_tokens: int | None = None, batch_size: int = 500,
                 keep_samples: bool = False) -> dict:
        """Greedy completions of every test prompt, scored: {"reward": mean weighted reward,
        "rewards/<name>": each reward's mean, "accuracy": the accuracy reward's mean (0..1), if any}; with
        keep_samples, also "samples": every row's {"prompt", "completion", "rewards": {name: value or None},
        "total"}."""
        max_new_tokens = max_new_tokens or self.max_new_tokens
        if not self.test or max_new_tokens is None:
            raise ValueError(f"Task {self.name}: evaluate needs test rows and max_new_tokens (it has "
                             f"{len(self.test)} test rows, max_new_tokens={max_new_tokens})")
        ids = []                                   # TRL's completion_ids; log_metric/log_extra: accepted, not kept
        completions = greedy_completions(model, tokenizer, [r["prompt"] for r in self.test], max_new_tokens,
                                         batch_size, ids)
        per_func = self.rewards_per_func(self.test, completions, completion_ids=ids,
                                         log_metric=lambda name, value: None, log_extra=lambda column, values: None)
        total, metrics = combine_rewards(per_func, self.reward_weights, self.reward_names)
        result = {"reward": total.mean().item(), **metrics}
        if self.accuracy_reward is not None:
            result["accuracy"] = metrics[f"rewards/{self.accuracy_reward}"]
        if keep_samples:
            result["samples"] = [{"prompt": row["prompt"], "completion": text, "total": t,
                                  "rewards": {n: None if math.isnan(v) else v for n, v in zip(self.reward_names, values,
                                                                                              strict=True)}}
                                 for row, text, values, t in zip(self.test, completions, per_func.tolist(),
                                                                 total.tolist(), strict=True)]
        return result

    def eval_fn(self, tokenizer, max_new_tokens: int | None = None):
        """model -> one number for a run's evaluator: the accuracy, else the mean weighted reward
        (None when the task has no test rows). It keeps its last evaluation in `.last` (`HeldOut`)."""
        if not self.test:
            return None
        return HeldOut(self, tokenizer, max_new_tokens)


class HeldOut:
    """A task's held-out evaluation as a run's eval_fn: `held_out(model)` is the accuracy (else the mean weighted
    reward); `last` keeps that evaluation's whole result (each reward's mean, every row's completion and rewards)."""

    def __init__(self, task: Task, tokenizer, max_new_tokens: int | None = None):
        self.task, self.tokenizer, self.max_new_tokens, self.last = task, tokenizer, max_new_tokens, None
        self.key = "accuracy" if task.accuracy_reward is not None else "reward"

    def __call__(self, model) -> float:
        self.last = self.task.evaluate(model, self.tokenizer, self.max_new_tokens, keep_samples=True)
        return self.last[self.key]


def arithmetic_task(config: TaskConfig | None = None) -> Task:
    """The embedded task as a Task: its training split, its held-out split, its exact-match reward.

    Its held-out accuracy is `greedy_accuracy`'s: the same prompts, decoded greedily for the
    longest answer plus EOS, scored by the same verifier.
    """
    task = make_task(config)
    reward = arithmetic_reward if task.config.reverse_answer else task.reward
    return Task("arithmetic", task.rows("train"), task.rows("test"), [reward], [1.0],
                accuracy_reward=reward_name(reward), max_new_tokens=task.config.max_answer_length + 1)
