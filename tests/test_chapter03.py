"""chapters/03_memory.py: the --json calculator output, --model from a local config, bad flags."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from refusals import last_line, run_script
from transformers import Qwen2Config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "chapters" / "03_memory.py"


def run(*args, check=True):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_json_70b_on_8_gpus():
    out = json.loads(run("--params", "70e9", "--gpus", "8", "--gpu-mem-gb", "80", "--json").stdout)
    assert set(out["zero"]) == {"0", "1", "2", "3"}
    z = out["zero"]
    assert z["0"]["total"] == pytest.approx(1120e9)
    assert z["3"]["total"] == pytest.approx(140e9)
    for stage in z.values():
        parts = sum(stage[k] for k in ("weights", "grads", "master", "adam_m", "adam_v"))
        assert stage["total"] == pytest.approx(parts)
    # 1120 GB over 80 - 7 GB (4 k tokens, checkpointed)
    assert z["3"]["fits_with_checkpointing"] is False and z["3"]["min_gpus_with_checkpointing"] == 16
    acts = out["activations"]
    assert acts["full"] < acts["sqrt"] < acts["none"]
    assert out["bytes_per_param"]["total"] == 16


def test_tables_from_a_local_model_config(tmp_path):
    Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    text = run("--model", str(tmp_path), "--gpus", "2", "--gpu-mem-gb", "1").stdout
    assert "stage" in text and "LoRA" in text
    assert f"model shape from {tmp_path}'s config: 2 layers, hidden 64" in text and "note:" not in text


def test_params_without_model_says_which_shape_it_assumes():
    """--params alone silently took Llama-2-70B's shape for activations and LoRA (issue 9, item 16)."""
    text = run("--params", "1.3e9", "--gpus", "2").stdout
    assert "Llama-2-70B's (assumed: no --model)" in text and "80 layers, hidden 8192" in text
    assert "this shape has 69 B parameters, not 1.3 B" in text


def test_shape_flags_replace_the_assumed_shape():
    flags = ("--layers", "24", "--hidden", "2048", "--intermediate", "5504", "--heads", "16", "--kv-heads", "16",
             "--vocab", "32000")
    mine = json.loads(run("--params", "1.3e9", "--gpus", "2", "--json", *flags).stdout)
    assumed = json.loads(run("--params", "1.3e9", "--gpus", "2", "--json").stdout)
    assert mine["activations"]["shape_source"] == "from the shape flags"
    assert mine["activations"]["shape"]["num_layers"] == 24 and mine["activations"]["shape"]["num_params"] is None
    assert mine["activations"]["full"] < assumed["activations"]["full"] / 5
    assert mine["lora"]["trainable_params"] < assumed["lora"]["trainable_params"] / 5
    partial = json.loads(run("--params", "7e9", "--json", "--layers", "32").stdout)["activations"]
    assert partial["shape"]["num_layers"] == 32 and partial["shape"]["hidden_size"] == 8192
    assert "with num_layers=32" in partial["shape_source"]


def test_padding_mask_flag():
    plain = json.loads(run("--json").stdout)["activations"]
    padded = json.loads(run("--json", "--padding-mask").stdout)["activations"]
    assert padded["padding_mask"] and padded["none"] > plain["none"]


@pytest.mark.parametrize("args, message", [
    (("--gpus", "0"), "argument --gpus: 0: must be >= 1"),
    (("--gpus", "4", "--global-batch", "6"), "argument --global-batch: 6: not divisible by --gpus 4"),
    (("--global-batch", "0"), "argument --global-batch: 0: must be >= 1"),
    (("--precision", "fp8"), "argument --precision: invalid choice: 'fp8'"),
    (("--params", "-5"), "argument --params: -5: must be > 0"),
    (("--params", "nan"), "argument --params: nan: must be finite"),
    (("--gpu-mem-gb", "0"), "argument --gpu-mem-gb: 0: must be > 0"),
    (("--seq", "0"), "argument --seq: 0: must be >= 1"),
    (("--lora-rank", "-1"), "argument --lora-rank: -1: must be >= 1"),
    (("--hidden", "64", "--heads", "5"), "hidden_size=64 must be divisible by num_heads=5"),
    (("--layers", "x"), "argument --layers: invalid int value: 'x'"),
    (("--measure", "--batch", "-1"), "argument --batch: -1: must be >= 1"),
    (("--measure", "--world-sizes", "1,0"), "argument --world-sizes: 0: must be >= 1"),
    (("--measure", "--seq-measure", "5000"), "argument --seq-measure: 5000: must be in 1..1024"),
    (("--measure", "--repeats", "0"), "argument --repeats: 0: must be >= 1"),
    (("--model", "/nonexistent"), "argument --model: /nonexistent: no such directory, and not a hub id"),
])
def test_bad_flags_exit_2_with_one_line(args, message):
    """Checked before anything loads, in argparse's style: flag, value, valid range (issue 9, items 9-10)."""
    proc = run(*args, check=False)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("03_memory.py: error: ") and message in last, last
    assert "Traceback" not in proc.stderr


def test_a_model_config_with_a_negative_size(tmp_path):
    """hidden_size: -5 in config.json gave RuntimeError: negative dimension (issue 9, item 18)."""
    Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": -5}))
    proc = run("--model", str(tmp_path), check=False)
    assert proc.returncode == 2 and "hidden_size=-5: must be a positive integer" in proc.stderr
    assert "Traceback" not in proc.stderr
    (tmp_path / "config.json").unlink()
    proc = run("--model", str(tmp_path), check=False)
    assert proc.returncode == 2 and "no config.json in" in proc.stderr


def _chapter():
    import importlib.util

    spec = importlib.util.spec_from_file_location("chapter03", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_returns_the_exit_status(monkeypatch, capsys, tmp_path):
    """0 on success; a failed measurement job is 1 with its cause on the last line (not a dict and exit 0)."""
    chapter = _chapter()
    assert chapter.main(["--params", "7e9", "--json"]) == 0

    def failing(args):
        raise RuntimeError("measurement job (world_size=2) failed with code -6:\nrank 0: terminate called")

    monkeypatch.setattr(chapter, "measure", failing)
    assert chapter.main(["--measure", "--out", str(tmp_path)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "error: the measurement job failed: measurement job (world_size=2) failed with code -6:", last


def test_the_tables_and_a_mistyped_flag_need_no_torch():
    proc, imported = run_script(SCRIPT, "--gpus", "8", "--gpu-mem-gb", "80", "--jsno")
    assert proc.returncode == 2 and last_line(proc).endswith("unrecognized arguments: --jsno")
    assert "torch" not in imported
    proc, imported = run_script(SCRIPT, "--params", "70e9", "--json")
    assert proc.returncode == 0 and "torch" not in imported and "transformers" not in imported, \
        "the calculator reads no model: it loads neither"
