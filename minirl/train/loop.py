# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""The single-process RL loop (stage 1): generate -> reward -> update -> synchronize.

Small stage functions (`generate`, `score`, `compute_reference`, `compute_advantages`,
`update_policy`, `update_critic`, `sync_weights`) and a thin `train` that calls them in order,
times each stage, logs one JSONL record per step, evaluates, checkpoints and resumes.
Later stages call the same functions from other orchestrations (torchrun, Ray).

Simplified vs TRL's GRPOTrainer: one process, one optimizer step per generation batch and
iteration (no gradient accumulation, no micro-batches), rewards summed over reward functions
(no weights), and a separate rollout copy of the policy with a version counter (TRL samples
with the training model itself). PPO puts its KL penalty in the per-token reward (as TRL's
PPOTrainer); GRPO adds the k3 KL to the loss (as TRL's GRPOTrainer).
"""

import copy
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from minirl.algo.advantages import SCALE_REWARDS, gae, group_advantages, terminal_rewards, whiten
from minirl.models.critic import ValueModel
from minirl.algo.logprobs import completion_logprobs, masked_mean
from minirl.algo.losses import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, policy_loss, value_loss
from minirl.rollout.hf import ROLLOUT_DTYPES, ROLLOUT_ENGINES, HFRollout, Rollout, check_tokenizer

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class GRPOConfig:
    """One RL run. Names follow TRL's GRPOConfig where the concept is the same."""

    algo: str = "grpo"                 # "grpo" (group advantages) | "ppo" (actor + critic, GAE)
    steps: int = 600                   # generation batches (= optimizer steps when num_iterations=1)
    prompts_per_step: int = 16         # B prompts per batch; the batch has B * num_generations rows
    num_generations: int = 8           # G completions per prompt (GRPO's group)
    max_completion_length: int = 4     # new tokens per completion (3 answer digits + EOS)
    temperature: float = 1.0
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    beta: float = 0.0                  # KL coefficient to the frozen reference (GRPO: loss; PPO: reward)
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: = epsilon
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    importance_sampling_level: str = "token"
    num_iterations: int = 1            # updates per generation batch (TRL's mu)
    seed: int = 0
    rollout_dtype: str = "float32"     # the rollout copy's precision (notebook 02's mismatch lab)
    rollout_engine: str = "shared_prefix"   # "hf": HF generate over B * G rows (section 10)
    use_bias_correction_kl: bool = False    # KL term times the importance ratio (TRL 1.16's default)
    importance_sampling_correction: bool = False   # truncated IS vs the rollout's behaviour log-probs
    importance_sampling_mode: str = "token_truncate"
    importance_sampling_cap: float = 2.0
    # PPO only
    value_learning_rate: float = 1e-3
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    # bookkeeping
    reward_errors: str = "raise"       # "raise" | "zero": a reward function failing on a sample scores 0
    eval_every: int = 100              # held-out greedy accuracy every N steps (and at the end); 0: never
    checkpoint_every: int = 0          # 0: no checkpoints
    keep_checkpoints: int = 2
    device: str = "cpu"

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"GRPOConfig.{name}={getattr(self, name)!r}: {why}")
        choices = {"algo": ("grpo", "ppo"), "loss_type": LOSS_TYPES, "scale_rewards": SCALE_REWARDS,
                   "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS, "rollout_dtype": ROLLOUT_DTYPES,
                   "rollout_engine": ROLLOUT_ENGINES,
                   "importance_sampling_mode": IS_MODES, "reward_errors": ("raise", "zero")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                bad(name, f"use one of {allowed}")
        if self.algo == "grpo" and self.num_generations < 2:
            bad("num_generations", "GRPO needs a group of at least 2 completions per prompt; use >= 2")
        if self.num_generations < 1:
            bad("num_generations", "use >= 1")
        for name in ("steps", "prompts_per_step", "max_completion_length", "num_iterations"):
            if getattr(self, name) < 1:
                bad(name, "must be >= 1")
        for name in ("temperature", "learning_rate", "max_grad_norm", "importance_sampling_cap"):
            if not getattr(self, name) > 0:
                bad(name, "must be > 0")
        if self.epsilon_high is not None and self.epsilon_high < 0 or self.epsilon < 0:
            bad("epsilon", "clipping ranges must be >= 0")
        if self.eval_every < 0 or self.checkpoint_every < 0:
            bad("eval_every" if self.eval_every < 0 else "checkpoint_every", "must be >= 0 (0 turns it off)")


@dataclass
class Experience:
    """One generation batch and everything computed from it before the update. N = B * G."""

    rollout: Rollout
    rewards: Tensor                      # [N]
    advantages: Tensor | None = None     # [N] (GRPO) or [N, C] (PPO)
    old_logps: Tensor | None = None      # [N, C] trainer log-probs before the update (None: = logps.detach())
    ref_logps: Tensor | None = None      # [N, C] frozen reference
    values: Tensor | None = None         # [N, C] critic values before the update (PPO)
    returns: Tensor | None = None        # [N, C] critic targets (PPO)
    is_weights: Tensor | None = None     # [N, C] importance-sampling weights vs the rollout (notebook 02)


@dataclass
class LoopState:
    """Everything that changes during a run, and what a checkpoint must restore."""

    model: torch.nn.Module
    tokenizer: object
    rollout: HFRollout
    optimizer: torch.optim.Optimizer
    generator: torch.Generator           # draws prompts and sampling seeds
    ref_model: torch.nn.Module | None = None
    value_model: ValueModel | None = None
    value_optimizer: torch.optim.Optimizer | None = None
    step: int = 0
    version: int = 0
    extra: dict = field(default_factory=dict)


def sample_prompts(rows: list[dict], n: int, generator: torch.Generator) -> list[dict]:
    """n distinct dataset rows, drawn with `generator` (all rows if the dataset is smaller)."""
    if not rows:
        raise ValueError("dataset is empty: train needs rows like {'prompt': '27+35=', 'answer': 62}")
    picks = torch.randperm(len(rows), generator=generator)[:n].tolist()
    return [rows[i] for i in picks]


def generate(rollout: HFRollout, rows: list[dict], config: GRPOConfig, expected_version: int,
             generator: torch.Generator) -> Rollout:
    """Stage 1: G completions for each row's prompt, from the expected policy version."""
    return rollout.generate([r["prompt"] for r in rows], config.num_generations, config.max_completion_length,
                            config.temperature, expected_version=expected_version, generator=generator)


def _reward_name(func) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _call_reward(func, prompts, completions, columns, reward_errors, errors: list) -> list[float]:
    try:
        return list(func(prompts=prompts, completions=completions, **columns))
    except Exception as err:
        if reward_errors == "raise":
            raise RuntimeError(f"reward function {_reward_name(func)} raised {type(err).__name__}: {err}; "
                               "fix it, or pass reward_errors='zero' to score failing samples 0") from err
    values = []
    for i in range(len(completions)):            # find the failing samples one by one
        try:
            values.append(float(func(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                                     **{k: v[i:i + 1] for k, v in columns.items()})[0]))
        except Exception as err:
            errors.append(f"{_reward_name(func)}[{i}]: {type(err).__name__}: {err}")
            values.append(0.0)
    return values


def score(reward_funcs: list, rollout: Rollout, rows: list[dict], config: GRPOConfig) -> tuple[Tensor, dict]:
    """Stage 2: rewards [N] (summed over functions) and metrics (per-function mean, error count)."""
    G = config.num_generations
    columns = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
    total = torch.zeros(len(rollout.completions))
    metrics, errors = {}, []
    for func in reward_funcs:
        values = _call_reward(func, rollout.prompts, rollout.completions, columns, config.reward_errors, errors)
        name = _reward_name(func)
        if len(values) != len(rollout.completions):
            raise ValueError(f"reward function {name} returned {len(values)} rewards for "
                             f"{len(rollout.completions)} completions: reward_funcs must return one float each")
        values = torch.tensor([math.nan if v is None else float(v) for v in values])
        if not torch.isfinite(values).all():
            if config.reward_errors == "raise":
                raise ValueError(f"reward function {name} returned non-finite rewards "
                                 f"({(~torch.isfinite(values)).sum().item()} of {len(values)}); return finite "
                                 "floats, or pass reward_errors='zero' to score them 0")
            errors += [f"{name}[{i}]: non-finite" for i in torch.nonzero(~torch.isfinite(values)).flatten().tolist()]
            values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        metrics[f"rewards/{name}"] = values.mean().item()
        total += values
    metrics["reward_errors"] = len(errors)
    if errors:
        metrics["reward_error_examples"] = errors[:3]
    return total, metrics


@torch.no_grad()
def compute_reference(state: LoopState, rollout: Rollout, config: GRPOConfig) -> dict:
    """old_logps, ref_logps, values [N, C] (each None when this config does not need it)."""
    ids, mask, C = rollout.input_ids, rollout.attention_mask, rollout.num_completion_tokens
    G = config.num_generations                   # rows come as G completions per prompt: share the prompt
    out = {"old_logps": None, "ref_logps": None, "values": None}
    needs_old = (config.num_iterations > 1 or config.importance_sampling_correction
                 or (config.algo == "ppo" and config.beta > 0))
    if needs_old:
        out["old_logps"] = completion_logprobs(state.model, ids, mask, C, config.temperature, num_generations=G)[0]
    if state.ref_model is not None:
        out["ref_logps"] = completion_logprobs(state.ref_model, ids, mask, C, config.temperature,
                                               num_generations=G)[0]
    if state.value_model is not None:
        out["values"] = state.value_model(ids, mask, C) * rollout.completion_mask
    return out


def compute_advantages(exp: Experience, config: GRPOConfig) -> Experience:
    """GRPO: group-normalized [N]. PPO: terminal reward (minus beta * k1 KL per token), GAE, whitened [N, C]."""
    if config.algo == "grpo":
        exp.advantages = group_advantages(exp.rewards, config.num_generations, config.scale_rewards)
        return exp
    mask = exp.rollout.completion_mask
    token_rewards = terminal_rewards(exp.rewards, mask)                    # [N, C]
    if config.beta > 0:
        token_rewards = token_rewards - config.beta * (exp.old_logps - exp.ref_logps) * mask
    advantages, exp.returns = gae(token_rewards, exp.values, mask, config.gamma, config.lam)
    exp.advantages = whiten(advantages, mask)
    return exp


def _step(params, optimizer, loss: Tensor, max_grad_norm: float) -> tuple[bool, float]:
    """backward + clip + step, unless the loss or gradient norm is non-finite. Returns (stepped, grad_norm)."""
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return False, math.nan
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return False, grad_norm
    optimizer.step()
    return True, grad_norm


def update_policy(model, optimizer, exp: Experience, config: GRPOConfig) -> dict:
    """Stage 3: `num_iterations` optimizer steps on this batch. Returns the last step's metrics.

    The rollout's rows must come as config.num_generations completions per prompt (each
    prompt's forward pass is shared by its group, see `completion_logprobs`).
    """
    ro = exp.rollout
    mask = ro.completion_mask
    model.train()
    metrics = {}
    for _ in range(config.num_iterations):
        logps, entropy = completion_logprobs(model, ro.input_ids, ro.attention_mask, ro.num_completion_tokens,
                                             config.temperature, with_entropy=True,
                                             num_generations=config.num_generations)
        old = logps.detach() if exp.old_logps is None else exp.old_logps
        if config.importance_sampling_correction and exp.is_weights is None:
            from minirl.algo.corrections import importance_sampling_weights  # notebook 02
            exp.is_weights = importance_sampling_weights(old, ro.logprobs, mask, config.importance_sampling_mode,
                                                         config.importance_sampling_cap)
        loss, metrics = policy_loss(logps, old, exp.advantages, mask, epsilon=config.epsilon,
                                    epsilon_high=config.epsilon_high, loss_type=config.loss_type,
                                    importance_sampling_level=config.importance_sampling_level, beta=config.beta
                                    if config.algo == "grpo" else 0.0, ref_logps=exp.ref_logps,
                                    max_completion_length=config.max_completion_length, is_weights=exp.is_weights,
                                    use_bias_correction_kl=config.use_bias_correction_kl)
        stepped, grad_norm = _step(model.parameters(), optimizer, loss, config.max_grad_norm)
        metrics.update(loss=loss.item(), grad_norm=grad_norm, skipped=int(not stepped),
                       entropy=masked_mean(entropy.detach(), mask).item(),
                       # rollout vs trainer log-prob gap on the sampled tokens (0 up to rounding in fp32)
                       logprob_diff_abs=masked_mean((old - ro.logprobs).abs(), mask).item())
    model.eval()
    return metrics


def update_critic(value_model, value_optimizer, exp: Experience, config: GRPOConfig) -> dict:
    """PPO's critic step: clipped value loss toward the GAE returns."""
    ro = exp.rollout
    value_model.train()
    values = value_model(ro.input_ids, ro.attention_mask, ro.num_completion_tokens)
    loss = value_loss(values, exp.values, exp.returns, ro.completion_mask, config.cliprange_value, config.loss_type)
    stepped, grad_norm = _step(value_model.parameters(), value_optimizer, loss, config.max_grad_norm)
    value_model.eval()
    return {"value_loss": loss.item(), "value_grad_norm": grad_norm, "value_skipped": int(not stepped),
            "value_mean": masked_mean(exp.values, ro.completion_mask).item()}


def sync_weights(model, rollout: HFRollout, version: int) -> int:
    """Stage 4: copy the trainer's weights into the rollout engine as `version + 1`; returns it."""
    rollout.load_weights(model.state_dict(), version + 1)
    return version + 1


def setup(config: GRPOConfig, model, tokenizer) -> LoopState:
    """The state of a fresh run: rollout copy, optimizer(s), reference, critic, generator."""
    check_tokenizer(tokenizer)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    model.to(config.device).eval()
    ref_model = None
    if config.beta > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    value_model = value_optimizer = None
    if config.algo == "ppo":
        value_model = ValueModel.from_policy(model).eval()
        value_optimizer = torch.optim.AdamW(value_model.parameters(), lr=config.value_learning_rate,
                                            weight_decay=config.weight_decay)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    return LoopState(model=model, tokenizer=tokenizer, optimizer=optimizer,
                     rollout=HFRollout(model, tokenizer, config.rollout_dtype, device=config.device,
                                       engine=config.rollout_engine),
                     generator=torch.Generator().manual_seed(config.seed), ref_model=ref_model,
                     value_model=value_model, value_optimizer=value_optimizer)


def train_step(state: LoopState, rows: list[dict], reward_funcs: list, config: GRPOConfig) -> dict:
    """One pass generate -> score -> reference/values -> advantages -> update -> sync, each stage timed."""
    times = {}

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        result = fn(*args)
        times[f"time/{name}"] = time.perf_counter() - t0
        return result

    batch = sample_prompts(rows, config.prompts_per_step, state.generator)
    ro = timed("generate", generate, state.rollout, batch, config, state.version, state.generator)
    rewards, metrics = timed("score", score, reward_funcs, ro, batch, config)
    exp = Experience(ro, rewards, **timed("reference", compute_reference, state, ro, config))
    timed("advantages", compute_advantages, exp, config)
    metrics |= timed("update", update_policy, state.model, state.optimizer, exp, config)
    if state.value_model is not None:
        metrics |= timed("update_critic", update_critic, state.value_model, state.value_optimizer, exp, config)
    state.version = timed("sync", sync_weights, state.model, state.rollout, state.version)
    state.step += 1
    C = ro.completion_mask.float()
    metrics |= {"step": state.step, "version": state.version, "generated_version": ro.version,
                "reward": rewards.mean().item(), "reward_std": rewards.std().item(),
                "completion_length": C.sum(1).mean().item()}
    return metrics | times


def train(config: GRPOConfig, model=None, tokenizer=None, task=None, reward_funcs=None, out_dir=None,
          progress: bool = True, dataset: list[dict] | None = None, resume: bool = False,
          stop_after: int | None = None, eval_fn=None) -> list[dict]:
    """Run `config.steps` steps of the loop; returns one metrics dict per evaluation/step.

    model/tokenizer: default the embedded warm-started policy; task: default `make_task()`;
    dataset: rows {"prompt", **columns} (default task.rows("train")); reward_funcs: TRL-style
    functions (default [task.reward]); eval_fn(model) -> accuracy (default held-out greedy
    accuracy on task.test). With out_dir: metrics.jsonl, and checkpoints every
    `checkpoint_every` steps under out_dir/checkpoints; resume=True continues from the latest.
    stop_after=K returns right after the checkpoint at step K (simulates a crash).
    """
    from minirl.train.checkpoint import latest_checkpoint, restore_state, save_checkpoint
    from minirl.models.policy import greedy_accuracy, load_default_policy
    from minirl.tasks.arithmetic import make_task

    if model is None or tokenizer is None:
        model, tokenizer, _ = load_default_policy(device=config.device, progress=progress)
    task = task or make_task()
    rows = task.rows("train") if dataset is None else list(dataset)
    if not rows:
        raise ValueError("dataset is empty: pass rows like {'prompt': '27+35=', 'answer': 62}")
    if "prompt" not in rows[0]:
        raise ValueError(f"dataset rows need a 'prompt' column; got columns {sorted(rows[0])}")
    reward_funcs = [task.reward] if reward_funcs is None else list(reward_funcs)
    if not reward_funcs:
        raise ValueError("reward_funcs is empty: pass at least one f(prompts, completions, **columns)")
    eval_fn = eval_fn or (lambda m: greedy_accuracy(m, tokenizer, task))
    state = setup(config, model, tokenizer)
    metrics: list[dict] = []
    out_dir = Path(out_dir) if out_dir is not None else None
    log_path = out_dir / "metrics.jsonl" if out_dir is not None else None
    checkpoint = latest_checkpoint(out_dir / "checkpoints") if (resume and out_dir is not None) else None
    if checkpoint is not None:
        metrics = restore_state(checkpoint, state)                 # weights, optimizer, RNGs, step, version
        _write_jsonl(log_path, metrics)
    elif out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_jsonl(log_path, [])
    if state.step == 0 and config.eval_every:
        metrics.append({"step": 0, "version": 0, "accuracy": eval_fn(state.model)})
        _append_jsonl(log_path, metrics[-1])
    bar = tqdm(total=config.steps, initial=state.step, desc=f"{config.algo} (stage 1)", disable=not progress)
    while state.step < config.steps:
        t0 = time.perf_counter()
        record = train_step(state, rows, reward_funcs, config)
        if config.eval_every and (state.step % config.eval_every == 0 or state.step == config.steps):
            t1 = time.perf_counter()
            record["accuracy"] = eval_fn(state.model)
            record["time/eval"] = time.perf_counter() - t1
        record["time/step"] = time.perf_counter() - t0
        metrics.append(record)
        _append_jsonl(log_path, record)
        bar.update(1)
        bar.set_postfix(reward=f"{record['reward']:.2f}", **({"acc": f"{record['accuracy']:.2f}"}
                                                             if "accuracy" in record else {}))
        if out_dir is not None and config.checkpoint_every and state.step % config.checkpoint_every == 0:
            save_checkpoint(out_dir / "checkpoints", state, metrics, config, keep=config.keep_checkpoints)
            if stop_after is not None and state.step >= stop_after:
                break
    bar.close()
    return metrics


def _write_jsonl(path, records: list[dict]) -> None:
    if path is not None:
        from minirl.utils.cli import atomic_write_text
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def _append_jsonl(path, record: dict) -> None:
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def plot_metrics(metrics: list[dict], path=None, title: str = "stage 1"):
    """Reward per step and held-out accuracy; saved to `path` if given. Returns the figure."""
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics if "reward" in m]
    reward = [m["reward"] for m in metrics if "reward" in m]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, reward, lw=0.6, alpha=0.5, label="batch reward (temperature 1)")
    k = max(1, len(reward) // 20)
    smooth = [sum(reward[max(0, i - k + 1):i + 1]) / len(reward[max(0, i - k + 1):i + 1]) for i in range(len(reward))]
    ax.plot(steps, smooth, lw=1.5, label=f"reward, mean of {k}")
    evals = [(m["step"], m["accuracy"]) for m in metrics if "accuracy" in m]
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out greedy accuracy")
    ax.set(xlabel="step", ylabel="reward / accuracy", ylim=(0, 1.02), title=title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
