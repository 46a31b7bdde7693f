"""chapters/03_memory.py: the --json calculator output, --model from a local config, bad flags."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
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
    assert z["3"]["fits_with_checkpointing"] is False and z["3"]["min_gpus_with_checkpointing"] == 16  # 1120 GB over 80 - 7 GB (4 k tokens, checkpointed)
    acts = out["activations"]
    assert acts["full"] < acts["sqrt"] < acts["none"]
    assert out["bytes_per_param"]["total"] == 16


def test_tables_from_a_local_model_config(tmp_path):
    Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    text = run("--model", str(tmp_path), "--gpus", "2", "--gpu-mem-gb", "1").stdout
    assert "stage" in text and "LoRA" in text


@pytest.mark.parametrize("args, match", [
    (("--gpus", "0"), "--gpus=0"),
    (("--gpus", "4", "--global-batch", "6"), "--global-batch=6 is not divisible by --gpus=4"),
    (("--precision", "fp8"), "invalid choice: 'fp8'"),
    (("--params", "-5"), "--params=-5"),
])
def test_bad_flags(args, match):
    proc = run(*args, check=False)
    assert proc.returncode != 0 and match in proc.stderr + proc.stdout
