"""--config FILE.yaml (TRL's convention): typed and checked as flags are, overridden by them, errors name the file."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from minirl.config import RLConfig
from minirl.runtime.cli import (
    ConfigFileParser,
    add_config_flags,
    common_parser,
    config_from_args,
    explicit_dests,
    merged_settings,
)


def make_parser() -> ConfigFileParser:
    parser = common_parser("test", seed=False, device=False)
    parser.add_argument("--reward", action="append", default=None)
    parser.add_argument("--reward-weights", type=float, nargs="+", default=None)
    parser.add_argument("--dry-run", action="store_true")
    add_config_flags(parser, RLConfig())
    return parser


def parse(tmp_path, text: str, *argv: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    parser = make_parser()
    args = parser.parse_args(["--config", str(path), *argv])
    return parser, args, config_from_args(parser, args, RLConfig())


def test_settings_are_typed_as_flags(tmp_path):
    text = """
learning_rate: 1e-5          # YAML reads this as a string; the flag's type makes it a float
num-generations: 4           # a '-' as in the flag is accepted
beta: 0.04
epsilon_high: none
importance_sampling_correction: yes
rollout_engine: hf
reward: [math, format]
reward_weights: [1, 0.5]
dry_run: true
model: Qwen/Qwen2.5-0.5B-Instruct
"""
    _, args, config = parse(tmp_path, text)
    assert config.optimizer.learning_rate == 1e-5 and isinstance(config.optimizer.learning_rate, float)
    assert config.sampling.num_generations == 4 and config.algorithm.beta == 0.04
    assert config.algorithm.epsilon_high is None and config.algorithm.importance_sampling_correction is True
    assert config.rollout.rollout_engine == "hf"
    assert args.reward == ["math", "format"] and args.reward_weights == [1.0, 0.5] and args.dry_run is True
    assert args.model == "Qwen/Qwen2.5-0.5B-Instruct"


def test_the_command_line_overrides_the_file(tmp_path):
    text = "learning_rate: 1.0e-5\nreward: [math, format]\nreward_weights: [1, 0.5]\nbeta: 0.1\n" \
           "importance_sampling_correction: true\n"
    _, args, config = parse(tmp_path, text, "--learning-rate", "3e-4", "--reward", "arithmetic",
                            "--reward-weights", "2", "--no-importance-sampling-correction")
    assert config.optimizer.learning_rate == 3e-4 and config.algorithm.beta == 0.1
    assert args.reward == ["arithmetic"], "a repeated flag on the command line replaces the file's list"
    assert args.reward_weights == [2.0] and config.algorithm.importance_sampling_correction is False
    _, args, config = parse(tmp_path, "", "--beta", "0.2")
    assert config.algorithm.beta == 0.2 and args.reward is None, "an empty file sets nothing"


def test_without_a_config_file_nothing_changes():
    parser = make_parser()
    assert vars(parser.parse_args([])) == vars(make_parser().parse_args([])) and parser.parse_args([]).config is None
    args = parser.parse_args(["--beta", "0.5", "--reward", "a", "--reward", "b"])
    assert args.beta == 0.5 and args.reward == ["a", "b"]


@pytest.mark.parametrize("text, message", [
    ("learning_rat: 1e-5\n", "'learning_rat' is no setting; did you mean learning_rate, value_learning_rate?"),
    ("colour: red\n", "'colour' is no setting; the settings are the flags' names with _"),
    ("num_generations: 0\n", "argument --num-generations: 0: must be >= 1 (set in --config"),
    ("learning_rate: abc\n", "argument --learning-rate: invalid float value: 'abc' (set in --config"),
    ("loss_type: nope\n", "argument --loss-type: invalid choice: 'nope'"),
    ("importance_sampling_correction: 3\n", "importance_sampling_correction: 3: give true or false"),
    ("dry_run: maybe\n", "dry_run: 'maybe': give true or false"),
    ("steps: [1, 2]\n", "steps: a list; --steps takes one value"),
    ("reward: {a: 1}\n", "reward: a mapping; give a value"),
    ("reward_weights: []\n", "reward_weights: an empty list"),
    ("- learning_rate\n", "holds a list, not a mapping of settings"),
    ("beta: [\n", "not valid YAML on line 2"),
    ("config: other.yaml\n", "a config file cannot name another"),
])
def test_bad_config_files_are_one_parser_error_naming_the_file(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit) as exit_:
        parse(tmp_path, text)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert str(tmp_path / "run.yaml") in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_a_missing_config_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--config", str(tmp_path / "absent.yaml")])
    assert "argument --config: " in capsys.readouterr().err


def test_a_bad_flag_still_names_the_flag_not_the_file(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("beta: 0.1\n")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--config", str(tmp_path / "run.yaml"), "--steps", "x"])
    err = capsys.readouterr().err
    assert "argument --steps: invalid int value: 'x'" in err and "set in --config" not in err


def test_config_settings_count_as_typed(tmp_path):
    """--resume compares the settings a user gave: those of the file are given too."""
    (tmp_path / "run.yaml").write_text("beta: 0.1\nreward: [math]\n")
    parser = make_parser()
    assert explicit_dests(parser, ["--config", str(tmp_path / "run.yaml"), "--steps", "3"]) == \
        {"config", "beta", "reward", "steps"}


def test_merged_settings_are_a_config_file_that_repeats_the_run(tmp_path):
    parser, args, config = parse(tmp_path, "learning_rate: 1.0e-5\nreward: [math, format]\n", "--steps", "7",
                                 "--out", str(tmp_path / "out"))
    settings = merged_settings(parser, args)
    assert settings["learning_rate"] == 1e-5 and settings["steps"] == 7 and settings["reward"] == ["math", "format"]
    assert settings["out"] == str(tmp_path / "out") and "config" not in settings and "help" not in settings
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(settings))
    again = make_parser().parse_args(["--config", str(tmp_path / "again.yaml")])
    assert merged_settings(parser, again) == settings
    assert config_from_args(parser, again, RLConfig()) == config


def test_a_plain_argparse_parser_gets_merged_settings_too():
    parser = argparse.ArgumentParser()
    parser.add_argument("--x", type=int, default=3)
    assert merged_settings(parser, parser.parse_args([])) == {"x": 3}


CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"


@pytest.mark.parametrize("chapter", sorted(p.name for p in CHAPTERS.glob("[0-9][0-9]_*.py")))
def test_every_chapter_takes_a_config_file(chapter, tmp_path):
    """--config on every chapter script: a key that is no setting is refused in one line naming the file."""
    script = CHAPTERS / chapter
    path = tmp_path / "run.yaml"
    path.write_text("no_such_setting: 1\n")
    proc = subprocess.run([sys.executable, str(script), "--config", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"argument --config: {path}: 'no_such_setting' is no setting" in proc.stderr


def test_chapter_03_reads_its_settings_from_the_file(tmp_path):
    """The calculator's flags from a YAML file; a typed flag still wins."""
    script = CHAPTERS / "03_memory.py"
    path = tmp_path / "mem.yaml"
    path.write_text("gpus: 4\nparams: 7.0e9\ngpu_mem_gb: 40\n")
    proc = subprocess.run([sys.executable, str(script), "--config", str(path), "--gpus", "2"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "7.00 B parameters" in proc.stdout and "2 GPUs of 40.0 GB" in proc.stdout


# TRL's GRPOConfig names (issue 31 item 1): a YAML written for TRL runs as is.

def grpo_yaml(tmp_path, **fields) -> Path:
    """TRL's own GRPOConfig(...).to_dict(), as a YAML file: every one of its 191 fields."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl import GRPOConfig

        config = GRPOConfig(output_dir=str(tmp_path / "trl_out"), report_to="none", bf16=False, use_cpu=True,
                            **fields)
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    return path


def chapter_settings(name: str, argv: list[str], monkeypatch, world: int = 1):
    import importlib.util

    monkeypatch.setenv("WORLD_SIZE", str(world))
    spec = importlib.util.spec_from_file_location(f"chapter_{name}", CHAPTERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args(argv)[-1]


def test_the_tables_know_every_field_of_trls_grpoconfig():
    import dataclasses

    from trl import GRPOConfig

    from minirl.runtime.trl_config import GRPO_FIELDS
    assert GRPO_FIELDS == {f.name for f in dataclasses.fields(GRPOConfig)}


@pytest.mark.parametrize("chapter", ["01_single_process", "07_async"])
def test_trls_own_grpoconfig_dump_runs_on_chapters_01_and_07(chapter, tmp_path, monkeypatch, capsys):
    """TRL's names become the chapter's (max_steps, the batch, save_steps, output_dir, the schedule); TRL's
    other fields at their defaults are counted in one line; what the chapter does not use is named there."""
    path = grpo_yaml(tmp_path, max_steps=3, per_device_train_batch_size=16, gradient_accumulation_steps=2,
                     num_generations=8, learning_rate=1e-5, max_completion_length=4, save_steps=2,
                     logging_steps=1, lr_scheduler_type="linear", warmup_steps=0.5, seed=3)
    settings = chapter_settings(chapter, ["--config", str(path)], monkeypatch)
    assert settings["steps"] == 3 and settings["prompts_per_step"] == 16 * 2 // 8
    assert settings["learning_rate"] == 1e-5 and settings["max_completion_length"] == 4
    assert settings["checkpoint_every"] == 2 and settings["seed"] == 3 and settings["loss_type"] == "dapo"
    assert settings["out"] == str(tmp_path / "trl_out")
    assert settings["lr_scheduler_type"] == "linear" and settings["warmup_steps"] == 0.5
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "TRL settings this chapter does not use" in line]
    assert len(said) == 1 and "logging_steps=1 (minirl logs every step)" in said[0], err
    assert "more at TRL's defaults" in said[0]


def test_chapter_04_takes_trls_lora_precision_and_checkpointing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "peft.yaml"
    path.write_text("use_peft: true\nlora_r: 8\nlora_alpha: 16\nlora_target_modules: [q_proj, v_proj]\n"
                    "bf16: true\ngradient_checkpointing: true\nper_device_train_batch_size: 8\n"
                    "num_generations: 4\nmax_steps: 2\n")
    settings = chapter_settings("04_fsdp_lora", ["--config", str(path)], monkeypatch, world=2)
    assert settings["lora_rank"] == 8 and settings["lora_alpha"] == 16.0
    assert settings["lora_target_modules"] == "q_proj,v_proj" and settings["mixed_precision"] == "bf16"
    assert settings["gradient_checkpointing"] is True
    assert settings["prompts_per_step"] == 8 * 2 // 4, "per device: 8 completions on each of 2 ranks"
    settings = chapter_settings("01_single_process", ["--config", str(path)], monkeypatch)
    said = capsys.readouterr().err
    assert "use_peft=true (this chapter trains every weight; LoRA: chapter 04)" in said, said


@pytest.mark.parametrize("text, message", [
    ("top_p: 0.9\n", "top_p: 0.9: minirl samples from the whole distribution (top_p 1); remove it or set it to 1.0"),
    ("mask_truncated_completions: true\n", "mask_truncated_completions: true: minirl trains on truncated "
     "completions as they are; remove it or set it to false"),
    ("use_vllm: true\nvllm_mode: server\n", "vllm_mode: server: minirl runs vLLM inside the training process"),
    ("per_device_train_batch_size: 12\nnum_generations: 8\n",
     "per_device_train_batch_size: 12: 12 x 1 (gradient_accumulation_steps) x 1 rank(s) "
     "= 12 completions do not make whole groups of num_generations=8"),
    ("adam_beta2: 0.95\n", "adam_beta2: 0.95: minirl has no such setting (TRL's default is 0.999)"),
    ("save_strategy: epoch\n", "save_strategy: 'epoch': minirl has no epochs"),
    ("max_steps: 5\nsteps: 6\n", "max_steps: 5 and steps: 6 set the same thing; keep one"),
])
def test_a_trl_setting_no_chapter_honours_is_refused_with_its_reason(text, message, tmp_path, monkeypatch, capsys):
    path = tmp_path / "trl.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        chapter_settings("01_single_process", ["--config", str(path)], monkeypatch)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument --config: {path}: {message}" in err, err


def test_a_typo_is_refused_before_trl_or_torch_load(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("learning_rte: 1e-5\n")
    code = ("import sys; sys.argv = ['x', '--config', sys.argv[1]]\n"
            "from minirl.runtime.cli import common_parser\n"
            "try:\n    common_parser('t').parse_args()\n"
            "except SystemExit:\n    print(sorted(m for m in ('torch', 'trl') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[]" and "'learning_rte' is no setting" in proc.stderr, proc.stderr


def test_the_schedule_is_transformers_own_and_moves_the_optimizers():
    """LRSchedule's factor is get_scheduler's at every step; the actor's and critic's rates follow it."""
    from types import SimpleNamespace

    import torch
    from transformers import get_scheduler

    from minirl.runtime.schedule import LRSchedule
    schedule = LRSchedule("linear", 0.25, total_steps=8)   # a quarter of the run warms up: 2 steps
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    reference = get_scheduler("linear", probe, num_warmup_steps=2, num_training_steps=8)
    expected = []
    for _ in range(8):
        expected.append(probe.param_groups[0]["lr"])
        probe.step()
        reference.step()
    assert [schedule.factor(s) for s in range(8)] == pytest.approx(expected)
    assert expected[0] == 0 and expected[2] == 1 and expected[7] < 0.2
    actor = SimpleNamespace(optimizer=torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.5))
    critic = SimpleNamespace(optimizer=torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.5))
    state = SimpleNamespace(step=1, roles=SimpleNamespace(actor=actor, critic=critic),
                            config=RLConfig().replace(learning_rate=1e-3, value_learning_rate=4e-3))
    schedule.on_start(state)
    assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * expected[1])
    assert critic.optimizer.param_groups[0]["lr"] == pytest.approx(4e-3 * expected[1])


# A tracker (issue 31 item 6): --report-to tensorboard writes TRL-named scalars that TensorBoard reads back.

def test_report_to_tensorboard_writes_trls_names_that_tensorboard_reads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(CHAPTERS / "01_single_process.py"), "--out", str(out), "--steps", "4",
                           "--eval-every", "2", "--report-to", "tensorboard"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/reward", "train/rewards/arithmetic_reward/mean", "train/completions/mean_length", "train/loss",
            "train/frac_reward_zero_std", "eval/accuracy"} <= tags, sorted(tags)
    rewards = [(e.step, e.value) for e in events.Scalars("train/reward")]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rewards == [(r["step"], pytest.approx(r["reward"])) for r in logged if "reward" in r]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [2, 4]


def test_a_tracker_that_is_not_installed_is_one_line(tmp_path):
    import importlib.util

    missing = next((n for n in ("wandb", "trackio") if importlib.util.find_spec(n) is None), None)
    if missing is None:
        pytest.skip("wandb and trackio are both installed here")
    proc = subprocess.run([sys.executable, str(CHAPTERS / "07_async.py"), "--out", str(tmp_path / "r"),
                           "--report-to", missing], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"07_async.py: error: argument --report-to: '{missing}': the {missing} package is not installed; "
        f"pip install {missing}, or use --report-to tensorboard")
