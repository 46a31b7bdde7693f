"""The warm-started tiny MoE policy, built once and cached: what notebook 08's RL runs start from.

Hand-written (a cache; the MoE policy itself is built in notebook 02, `minirl.runtime.moe_routes.build_moe_policy`,
and warm-started with notebook 00's recipe, `minirl.models.policy.warm_start`).

`load_moe_policy(tokenizer, task, warm_start_steps)` returns the tiny MoE after a supervised warm start
without any balancing, so whatever imbalance its router develops is there when RL begins. The result is
saved under `$MINIRL_CACHE` (`cache_dir()`, like the default policy) in a folder named by a hash of
everything that decides it (the warm-start format, the task's config, the steps, the seed, the vocabulary
size), and written atomically: it is saved to a temporary folder that is then renamed, so a reader sees all
of it or none of it, and when two processes build it at once the first to finish wins.
"""
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from minirl.models.policy import WARM_START_FORMAT, WarmStartConfig, warm_start
from minirl.runtime.moe_routes import build_moe_policy
from minirl.runtime.policy_cache import cache_dir


def load_moe_policy(tokenizer, task, warm_start_steps: int = 400, seed: int = 0, progress: bool = False):
    """The tiny MoE policy after a supervised warm start of `warm_start_steps` steps (no balancing),
    cached under $MINIRL_CACHE like the default policy (built once, written atomically)."""
    from transformers import Qwen2MoeForCausalLM

    key = json.dumps([WARM_START_FORMAT, asdict(task.config), warm_start_steps, seed, len(tokenizer)], sort_keys=True)
    path = cache_dir() / f"moe-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (path / "config.json").exists():
        model = build_moe_policy(tokenizer, seed=seed)
        warm_start(model, tokenizer, task, WarmStartConfig(steps=warm_start_steps, target_accuracy=None, seed=seed),
                   progress=progress)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
        model.save_pretrained(tmp)
        try:
            os.replace(tmp, path)               # atomic: readers see all of it or none of it
        except OSError:                         # another process finished first; keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return Qwen2MoeForCausalLM.from_pretrained(path).eval()
