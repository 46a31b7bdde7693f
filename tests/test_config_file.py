"""--config FILE.yaml (TRL's convention): typed and checked as flags are, overridden by them, errors name the file."""

import argparse
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
