"""Parity with TRL: minirl's GRPO loss, its gradients and its advantages equal TRL's GRPOTrainer's.

Both sides get the same weights, prompts, completions and rewards:

- TRL: a real `trl.GRPOTrainer` on the CPU. Its generation is replaced by fixed completions (a mock
  of `_generate_single_turn`), so that `_generate_and_score_completions` runs TRL's own code for
  tokenizing, padding, rewarding (`task.reward`) and normalizing the advantages; then
  `_compute_loss(model, inputs)` runs TRL's loss, and `backward()` gives its gradients.
- minirl: a fresh copy of the same weights, `completion_logprobs` + `group_advantages` +
  `policy_loss` on the very same tensors (and once with `num_generations=G`, the shared-prefix
  forward pass the loop uses); and the loop's own `Actor.backward` on a Rollout of those tensors,
  in micro-batches of similar length (notebook 01, section 10.3), for every loss_type.

Cases: every `loss_type` in {grpo, bnpo, dr_grpo, dapo}, and "cispo" (TRL 1.16's CISPO, added to minirl
through its loss registry alone); on-policy (`old_logps` = `logps`, what
TRL does when num_iterations = 1), off-policy (`old_logps` perturbed so that ratios leave
[1 - eps, 1 + eps] and clipping is active, as when num_iterations > 1), the same with a k3 KL
to a reference (beta > 0, temperature 0.7), and sequence-level ratios (GSPO). A negative control
shows that the comparison catches a flipped sign and a wrong normalization.

TRL settings: bf16=False (TRL autocasts to bf16 by default, even on a CPU) so both sides compute
in float32, and use_bias_correction_kl=False (the classic k3 term, minirl's default), except in
KL_BIAS_CORRECTED, where both multiply the KL term by the importance ratio (TRL 1.16's default).

Note: TRL scores completions without position ids (positions 0..T-1 on left-padded rows) while
minirl passes position ids from the attention mask, as generation does. For a rotary-position
model such as Qwen2 only position differences enter attention, so the two agree up to float
rounding; the tolerances below are float32 rounding tolerances.
"""

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from minirl.algo.advantages import group_advantages  # noqa: E402
from minirl.algo.logprobs import completion_logprobs  # noqa: E402
from minirl.algo.losses import policy_loss  # noqa: E402
from minirl.config import AlgorithmConfig, OptimizerConfig, SamplingConfig  # noqa: E402
from minirl.data import Experience, Rollout  # noqa: E402
from minirl.models.policy import PolicyConfig, build_policy, build_tokenizer  # noqa: E402
from minirl.roles.actor import Actor  # noqa: E402
from minirl.tasks.arithmetic import format_answer, make_task  # noqa: E402

NUM_PROMPTS = 4
G = 4  # num_generations

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def scenario(level="token", off_policy=True, beta=0.0, epsilon=0.2, epsilon_high=None, temperature=1.0,
             kl_bias_correction=False):
    return dict(level=level, off_policy=off_policy, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
                temperature=temperature, kl_bias_correction=kl_bias_correction)


SCENARIOS = {
    "on_policy": scenario(off_policy=False),                         # num_iterations = 1: old_logps = logps
    "clipped": scenario(epsilon_high=0.28),                          # old_logps perturbed: clipping is active
    "clipped_kl": scenario(beta=0.05, temperature=0.7),              # plus k3 KL to a reference
}
CASES = [(loss, name) for loss in LOSS_TYPES for name in SCENARIOS]
GSPO = {  # sequence-level importance ratios (GSPO); TRL recommends loss_type="grpo" for them
    "gspo_clipped": ("grpo", scenario(level="sequence")),
    "gspo_clipped_kl": ("grpo", scenario(level="sequence", beta=0.05, epsilon_high=0.28, temperature=0.7)),
    "gspo_dapo": ("dapo", scenario(level="sequence")),
}
# TRL 1.16 multiplies the KL term by the importance ratio by default (use_bias_correction_kl=True,
# DeepSeek-V3.2). The cases above switch it off (classic GRPO k3 term); these check the corrected
# variant, policy_loss(..., use_bias_correction_kl=True).
KL_BIAS_CORRECTED = {
    "dapo_kl_corrected": ("dapo", scenario(beta=0.05, kl_bias_correction=True)),
    "gspo_kl_corrected": ("grpo", scenario(level="sequence", beta=0.05, kl_bias_correction=True)),
}
# CISPO (loss_type="cispo"): TRL caps the importance weight at epsilon_high itself (ScaleRL recommends 5.0; unset,
# it is epsilon) and logs the share of capped tokens with A > 0 as "cispo_clip_ratio" instead of the clip ratios.
CISPO = {
    "cispo_capped": scenario(epsilon_high=1.2),                            # some ratios above the cap
    "cispo_kl": scenario(epsilon_high=5.0, beta=0.05, temperature=0.7),    # ScaleRL's cap, a k3 KL term
    "cispo_on_policy": scenario(off_policy=False),                         # epsilon_high unset: the cap is 0.2
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core machine, two threads' barriers stall whenever another
    process takes a core, and this file then runs ten times slower (88 s instead of 8 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def task():
    return make_task()


@pytest.fixture(scope="module")
def rows(task):
    """The first prompts of the training split, {"prompt", "answer"} (built once: rows() builds all of them)."""
    return task.rows("train")[:NUM_PROMPTS]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A tiny Qwen2 policy saved to disk, so both sides (and TRL's reference model) load the same weights."""
    tokenizer = build_tokenizer()
    model = build_policy(PolicyConfig(), tokenizer)
    with torch.no_grad():  # sharpen the random init so log-probs are far from uniform and gradients are not tiny
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    path = tmp_path_factory.mktemp("policy")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    return model


def fixed_completions(task, rows, tokenizer, generator):
    """G completion token lists per prompt: correct+eos, wrong+eos, truncated (no eos), random length+eos."""
    eos = tokenizer.eos_token_id
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    width = task.config.max_answer_length + 1
    completions = []
    for i, row in enumerate(rows):
        correct = tokenizer(format_answer(row["answer"], task.config.reverse_answer),
                            add_special_tokens=False)["input_ids"]
        wrong = tokenizer(format_answer(row["answer"] + 1, task.config.reverse_answer),
                          add_special_tokens=False)["input_ids"]
        rand_len = 1 + int(torch.randint(width - 1, (1,), generator=generator))
        random_ids = [digits[int(j)] for j in torch.randint(10, (rand_len - 1,), generator=generator)]
        truncated = [digits[int(j)] for j in torch.randint(10, (width,), generator=generator)]
        group = [correct + [eos], wrong + [eos], truncated, random_ids + [eos]]
        if i % 2:  # vary which row of the group is which, and give one group two correct answers
            group = group[::-1]
            group[1] = correct + [eos]
        completions.extend(group[:G])
    return completions


def make_trainer(task, policy_dir, rows, completions, rewards_seen, *, reward_values=None, loss_type="dapo",
                 importance_sampling_level="token", beta=0.0, epsilon=0.2, epsilon_high=None, temperature=1.0,
                 scale_rewards="group", kl_bias_correction=False):
    """A real GRPOTrainer on the CPU whose generation returns `completions` (one token list per row)."""
    tokenizer = build_tokenizer()

    def accuracy(prompts, completions, answer, **columns):
        rewards = task.reward(prompts, completions, answer=answer) if reward_values is None else list(reward_values)
        rewards_seen.append(rewards)
        return rewards

    args = GRPOConfig(
        output_dir=str(policy_dir.parent / "trl-output"), use_cpu=True, report_to="none",
        per_device_train_batch_size=len(rows) * G, num_generations=G,
        max_completion_length=task.config.max_answer_length + 1, temperature=temperature, beta=beta,
        epsilon=epsilon, epsilon_high=epsilon_high, loss_type=loss_type,
        importance_sampling_level=importance_sampling_level, scale_rewards=scale_rewards,
        save_strategy="no", logging_steps=1, disable_dropout=True, seed=0,
        bf16=False,  # TRL defaults to bf16 autocast; both sides compute in float32 here
        use_bias_correction_kl=kl_bias_correction)  # see KL_BIAS_CORRECTED
    trainer = GRPOTrainer(model=load_model(policy_dir), reward_funcs=accuracy, args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one micro-batch per optimizer step
    trainer.model.train()

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        assert len(prompt_ids) == len(completions), "one fixed completion per (prompt, generation) row"
        return [list(c) for c in completions], None

    trainer._generate_single_turn = generate
    return trainer


def build_batch(task, rows, policy_dir, loss_type, settings, seed=0):
    """Run TRL's scoring on fixed completions; return (trainer, inputs, rewards)."""
    beta = settings["beta"]
    tokenizer = build_tokenizer()
    generator = torch.Generator().manual_seed(seed)
    completions = fixed_completions(task, rows, tokenizer, generator)
    rewards_seen = []
    trainer = make_trainer(task, policy_dir, rows, completions, rewards_seen, loss_type=loss_type,
                           importance_sampling_level=settings["level"], beta=beta, epsilon=settings["epsilon"],
                           epsilon_high=settings["epsilon_high"], temperature=settings["temperature"],
                           kl_bias_correction=settings["kl_bias_correction"])
    inputs = trainer._generate_and_score_completions([row for row in rows for _ in range(G)])
    rewards = torch.tensor(rewards_seen[-1], dtype=torch.float32)
    mask = inputs["completion_mask"]
    if settings["off_policy"] or beta:
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([inputs["prompt_mask"], mask], 1), inputs["completion_ids"].size(1))
    if settings["off_policy"]:  # as after a few optimizer steps (num_iterations > 1): ratios spread around 1
        inputs["old_per_token_logps"] = logps + 0.35 * torch.randn(logps.shape, generator=generator) * mask
    if beta:
        inputs["ref_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=generator) * mask
    return trainer, inputs, rewards


def trl_loss_and_grads(trainer, inputs):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, metrics


def minirl_loss_and_grads(policy_dir, inputs, rewards, loss_type, settings, max_completion_length,
                          advantage_sign=1.0, num_generations=1):
    model = load_model(policy_dir)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logps, entropy = completion_logprobs(model, input_ids, attention_mask, inputs["completion_ids"].size(1),
                                         temperature=settings["temperature"], with_entropy=True,
                                         num_generations=num_generations)
    advantages = group_advantages(rewards, G, "group")
    old = inputs.get("old_per_token_logps")
    loss, metrics = policy_loss(
        logps, logps.detach() if old is None else old, advantage_sign * advantages, inputs["completion_mask"],
        epsilon=settings["epsilon"], epsilon_high=settings["epsilon_high"], loss_type=loss_type,
        importance_sampling_level=settings["level"], beta=settings["beta"],
        ref_logps=inputs.get("ref_per_token_logps"), max_completion_length=max_completion_length,
        use_bias_correction_kl=settings["kl_bias_correction"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    mask = inputs["completion_mask"]
    metrics = dict(metrics, entropy=((entropy * mask).sum() / mask.sum()).item())
    return loss.detach(), grads, metrics, logps.detach(), advantages


def minirl_micro_batched(policy_dir, inputs, rewards, loss_type, settings, max_completion_length, max_tokens):
    """The loop's own update: `Actor.backward` in micro-batches of at most `max_tokens` completion tokens."""
    model = load_model(policy_dir)
    mask = inputs["completion_mask"]
    N = mask.shape[0]
    ro = Rollout(prompt_ids=inputs["prompt_ids"], prompt_mask=inputs["prompt_mask"],
                 completion_ids=inputs["completion_ids"], completion_mask=mask, logprobs=torch.zeros(mask.shape),
                 completions=[""] * N, prompts=[""] * N, version=0, num_generations=G,
                 pad_token_id=build_tokenizer().pad_token_id)
    advantages = group_advantages(rewards, G, "group")
    exp = Experience(ro, rewards, advantages=advantages, old_logps=inputs.get("old_per_token_logps"),
                     ref_logps=inputs.get("ref_per_token_logps"))
    algorithm = AlgorithmConfig(loss_type=loss_type, beta=settings["beta"], epsilon=settings["epsilon"],
                                epsilon_high=settings["epsilon_high"], importance_sampling_level=settings["level"],
                                use_bias_correction_kl=settings["kl_bias_correction"])
    sampling = SamplingConfig(num_generations=G, max_completion_length=max_completion_length,
                              temperature=settings["temperature"])
    actor = Actor(model, algorithm, OptimizerConfig(max_tokens_per_microbatch=max_tokens), sampling)
    assert len(actor.micro_batches(ro)) > 2, "test setup: several micro-batches"
    model.train()
    model.zero_grad(set_to_none=True)
    metrics = actor.backward(exp)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return torch.tensor(metrics["loss"]), grads, metrics, actor.logprobs(ro), advantages


def max_grad_error(grads_a, grads_b):
    """Largest |a - b| over all parameters, relative to the largest |a| (so 0 means equal)."""
    scale = max(g.abs().max().item() for g in grads_a.values())
    return max((grads_a[n] - grads_b[n]).abs().max().item() for n in grads_a) / scale


def check_parity(task, rows, policy_dir, loss_type, settings, num_generations=1, max_tokens=None):
    trainer, inputs, rewards = build_batch(task, rows, policy_dir, loss_type, settings)
    case = f"loss_type={loss_type!r}, num_generations={num_generations}, max_tokens={max_tokens}, {settings}"
    trl_loss, trl_grads, trl_metrics = trl_loss_and_grads(trainer, inputs)
    if max_tokens is None:
        loss, grads, metrics, logps, advantages = minirl_loss_and_grads(
            policy_dir, inputs, rewards, loss_type, settings, trainer.max_completion_length,
            num_generations=num_generations)
    else:
        loss, grads, metrics, logps, advantages = minirl_micro_batched(
            policy_dir, inputs, rewards, loss_type, settings, trainer.max_completion_length, max_tokens)
    mask = inputs["completion_mask"].bool()

    assert rewards.view(-1, G).std(1).gt(0).any(), "test setup: some group must have mixed rewards"
    torch.testing.assert_close(advantages, inputs["advantages"], atol=1e-6, rtol=1e-5,
                               msg=lambda m: f"group_advantages differs from TRL's advantages:\n{m}")
    with torch.no_grad():
        trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1))
    torch.testing.assert_close(logps[mask], trl_logps[mask], atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"completion_logprobs differs from TRL's per-token log-probs:\n{m}")
    assert abs(loss.item() - trl_loss.item()) <= 1e-6 + 1e-5 * abs(trl_loss.item()), (
        f"{case}: minirl loss {loss.item():.8f} != TRL loss {trl_loss.item():.8f}")
    err = max_grad_error(trl_grads, grads)
    assert err < 1e-4, f"{case}: gradients differ from TRL's (max relative error {err:.2e})"
    atol = 1e-6 if num_generations == 1 else 1e-5   # a shared prompt: G copies' gradients summed in another order
    for name, (a, b) in {n: (grads[n], trl_grads[n]) for n in grads}.items():
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m, name=name: f"gradient of {name}:\n{m}")
    clip_keys = {"cispo_clip_ratio": "clip_ratio/high_mean"} if loss_type == "cispo" else {
        k: k for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")}
    for trl_key, key in {"entropy": "entropy", **clip_keys, **({"kl": "kl"} if settings["beta"] else {})}.items():
        assert key in metrics, f"policy_loss metrics lack {key!r} (TRL logs it as {trl_key!r})"
        assert abs(float(metrics[key]) - trl_metrics[trl_key]) < 1e-5, (
            f"metric {key}: minirl {float(metrics[key])} != TRL {trl_metrics[trl_key]}")
    return trl_metrics, trl_loss, trl_grads


@pytest.mark.parametrize("loss_type,scenario", CASES, ids=[f"{lt}-{s}" for lt, s in CASES])
def test_loss_and_gradients_match_trl(task, rows, policy_dir, loss_type, scenario):
    trl_metrics, _, trl_grads = check_parity(task, rows, policy_dir, loss_type, SCENARIOS[scenario])
    assert max(g.abs().max().item() for g in trl_grads.values()) > 1e-4, "test setup: gradients must not vanish"
    if SCENARIOS[scenario]["off_policy"]:  # clipping must really be exercised
        assert 0 < trl_metrics["clip_ratio/region_mean"] < 1, (
            f"test setup: expected some but not all tokens clipped, got {trl_metrics['clip_ratio/region_mean']}")


@pytest.mark.parametrize("case", list(GSPO))
def test_sequence_level_ratios_match_trl(task, rows, policy_dir, case):
    loss_type, settings = GSPO[case]
    trl_metrics, _, _ = check_parity(task, rows, policy_dir, loss_type, settings)
    assert 0 < trl_metrics["clip_ratio/region_mean"] < 1, "test setup: some but not all sequences clipped"


@pytest.mark.parametrize("case", list(KL_BIAS_CORRECTED))
def test_bias_corrected_kl_matches_trl(task, rows, policy_dir, case):
    loss_type, settings = KL_BIAS_CORRECTED[case]
    trl_metrics, _, _ = check_parity(task, rows, policy_dir, loss_type, settings)
    assert 0 < trl_metrics["clip_ratio/region_mean"] < 1, "test setup: off-policy, so the ratio is not 1"


@pytest.mark.parametrize("case", list(CISPO))
def test_cispo_matches_trl(task, rows, policy_dir, case):
    trl_metrics, trl_loss, _ = check_parity(task, rows, policy_dir, "cispo", CISPO[case])
    if case == "cispo_capped":
        assert 0 < trl_metrics["cispo_clip_ratio"] < 1, "test setup: some but not all tokens capped"


def test_micro_batched_cispo_matches_trl(task, rows, policy_dir):
    check_parity(task, rows, policy_dir, "cispo", CISPO["cispo_capped"], num_generations=G, max_tokens=4)


@pytest.mark.parametrize("loss_type,scenario", [("dapo", "clipped_kl"), ("grpo", "on_policy")])
def test_shared_prefix_forward_matches_trl(task, rows, policy_dir, loss_type, scenario):
    """The loop's path: each group's prompt runs once (num_generations=G); TRL runs every row's prompt."""
    check_parity(task, rows, policy_dir, loss_type, SCENARIOS[scenario], num_generations=G)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batched_update_matches_trl(task, rows, policy_dir, loss_type):
    """The loop's update in micro-batches of similar length, each prompt once (PromptCache): TRL's loss and
    gradients for every normalization, with clipping and a KL term."""
    check_parity(task, rows, policy_dir, loss_type, SCENARIOS["clipped_kl"], num_generations=G, max_tokens=4)


def test_micro_batched_sequence_ratios_match_trl(task, rows, policy_dir):
    check_parity(task, rows, policy_dir, *GSPO["gspo_clipped_kl"], num_generations=G, max_tokens=4)


def test_parity_check_catches_a_wrong_loss(task, rows, policy_dir):
    """Negative control: a flipped advantage sign, or the wrong normalization, must not pass as parity."""
    settings = SCENARIOS["clipped"]
    trainer, inputs, rewards = build_batch(task, rows, policy_dir, "grpo", settings)
    trl_loss, trl_grads, _ = trl_loss_and_grads(trainer, inputs)
    flipped, flipped_grads, *_ = minirl_loss_and_grads(policy_dir, inputs, rewards, "grpo", settings,
                                                       trainer.max_completion_length, advantage_sign=-1.0)
    assert abs(flipped.item() - trl_loss.item()) > 1e-3 and max_grad_error(trl_grads, flipped_grads) > 1e-2
    other, other_grads, *_ = minirl_loss_and_grads(policy_dir, inputs, rewards, "dr_grpo", settings,
                                                   trainer.max_completion_length)
    assert abs(other.item() - trl_loss.item()) > 1e-3 and max_grad_error(trl_grads, other_grads) > 1e-2


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_match_trl(task, rows, policy_dir, scale_rewards):
    """TRL's own reward normalization (run through _generate_and_score_completions) vs group_advantages."""
    tokenizer = build_tokenizer()
    completions = fixed_completions(task, rows, tokenizer, torch.Generator().manual_seed(1))
    reward_values = [0.3, 1.0, -0.5, 2.0,   # spread
                     1.0, 1.0, 1.0, 1.0,    # zero std: advantages 0 in every mode
                     0.0, 0.0, 1.0, 0.0,    # one success
                     5.0, -3.0, 0.25, 0.25]
    rewards_seen = []
    trainer = make_trainer(task, policy_dir, rows, completions, rewards_seen, reward_values=reward_values,
                           scale_rewards=scale_rewards)
    inputs = trainer._generate_and_score_completions([row for row in rows for _ in range(G)])
    rewards = torch.tensor(reward_values)
    ours = group_advantages(rewards, G, scale_rewards)
    torch.testing.assert_close(ours, inputs["advantages"], atol=1e-6, rtol=1e-5,
                               msg=lambda m: f"scale_rewards={scale_rewards!r}: advantages differ from TRL's:\n{m}")
    assert ours[4:8].abs().max() == 0, "a group with equal rewards must get zero advantages"


def test_benchmark_script_runs(policy_dir, tmp_path, capsys):
    """benchmarks/grpo_vs_trl.py end to end on the tiny policy: two pairs of steps, summary and last line."""
    import importlib.util
    import json
    import re
    import statistics
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "grpo_vs_trl.py"
    spec = importlib.util.spec_from_file_location("grpo_vs_trl", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", str(policy_dir), "--steps", "2", "--warmup", "1", "--prompts-per-step", "2",
                       "--num-generations", "2", "--out", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"speedup_vs_trl: (\S+) \(min (\S+), max (\S+), n (\d+)\)", last)
    assert match, f"the last line must be 'speedup_vs_trl: X (min A, max B, n N)', got {last!r}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["minirl_seconds"]) == 2 and len(summary["trl_seconds"]) == 2, "two measured steps each"
    ratios = [t / m for t, m in zip(summary["trl_seconds"], summary["minirl_seconds"], strict=True)]
    assert summary["speedup_vs_trl"] == pytest.approx(statistics.median(ratios)), "the median of per-pair ratios"
    x, lo, hi, n = (float(g) for g in match.groups())
    assert (x, lo, hi, n) == pytest.approx((summary["speedup_vs_trl"], min(ratios), max(ratios), 2), abs=0.006)
    with pytest.raises(SystemExit):
        bench.parse_args(["--num-generations", "1"])


def test_benchmark_pairs_alternate_which_trainer_runs_first():
    """grpo_vs_trl's callback runs the minirl step before TRL's step in even pairs and after it in odd ones."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "grpo_vs_trl.py"
    spec = importlib.util.spec_from_file_location("grpo_vs_trl", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    order = []
    timer = bench.TRLSteps(beside=lambda: order.append("minirl"))
    for _ in range(4):
        timer.on_step_begin(None, None, None)
        order.append("trl")
        timer.on_step_end(None, None, None)
    assert order == ["minirl", "trl", "trl", "minirl", "minirl", "trl", "trl", "minirl"]
    assert len(timer.seconds()) == 4
