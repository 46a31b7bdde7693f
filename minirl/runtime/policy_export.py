"""What rank 0 does with a stage-4 run's policy: score it on held-out prompts, and export it whole.

Hand-written plumbing for notebook 04's `minirl.parallel.spmd`. `evaluate_engine` scores a
task's held-out rows on the engine's copy (the trainer's latest weights, whole; vLLM through
its greedy completions; `EngineEval`, the run's eval_fn, keeps each reward's mean and the rows as
`Task.eval_fn`'s does); `export_policy` gathers the policy layer by layer (LoRA merged into
the base) and saves it on rank 0 in Hugging Face format, atomically (a temporary directory
renamed when whole), a failed write (a full disk) raised on every rank. A LoRA run's adapter
is saved beside it by peft itself, in `final/adapter/` (adapter_config.json and
adapter_model.safetensors: what `PeftModel.from_pretrained(base, path)` loads, as TRL's
`use_peft` runs save it).
"""

import contextlib
import errno
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

from safetensors import SafetensorError
from transformers import AutoModelForCausalLM

from minirl.parallel.launch import DistContext
from minirl.runtime.buckets import gather_buckets
from minirl.runtime.ranks import agree
from minirl.runtime.stops import deferred_signals
from minirl.sync.sharded import engine_tensors
from minirl.tasks.task import Task

ADAPTER = "adapter"      # a LoRA run's peft adapter: OUT/final/adapter/


def innermost(engine):
    """The engine under any wrappers (SeedPerPrompt, ColocatedEngine)."""
    while hasattr(engine, "engine"):
        engine = engine.engine
    return engine


def evaluate_engine(engine, tokenizer, task: Task, max_new_tokens: int) -> float:
    """The task's evaluation of the policy the engine holds (the trainer's latest weights, whole): its held-out
    rows decoded greedily and scored by its rewards; the accuracy (0..1) when the task has a correctness
    reward, else the mean weighted reward (`Task.eval_fn`'s number)."""
    inner = innermost(engine)
    if not hasattr(inner, "greedy_completions"):          # minirl's engines hold a transformers model
        return task.eval_fn(tokenizer, max_new_tokens)(inner.model)
    completions = inner.greedy_completions([r["prompt"] for r in task.test], max_new_tokens)     # vLLM
    total, metrics = task.score(task.test, completions)
    return metrics[f"rewards/{task.accuracy_reward}"] if task.accuracy_reward else total.mean().item()


class EngineEval:
    """Stage 4's eval_fn: `evaluate_engine` on what `engine` holds, keeping in `last` the whole evaluation (each
    reward's mean, every row's completion and rewards) as a Task's `HeldOut` does (not for vLLM's engine)."""

    def __init__(self, engine, tokenizer, task: Task, max_new_tokens: int):
        self.engine, self.tokenizer, self.task, self.max_new_tokens = engine, tokenizer, task, max_new_tokens
        self.last = None

    def __call__(self, _model=None) -> float:
        inner = innermost(self.engine)
        if hasattr(inner, "greedy_completions"):          # vLLM
            self.last = None
            return evaluate_engine(self.engine, self.tokenizer, self.task, self.max_new_tokens)
        held_out = self.task.eval_fn(self.tokenizer, self.max_new_tokens)
        value = held_out(inner.model)
        self.last = held_out.last
        return value


@contextlib.contextmanager
def _naming(file: Path):
    """safetensors' errors (which name no file) as the OSError they are, naming `file`."""
    try:
        yield
    except SafetensorError as err:
        code = re.search(r"(?:os error|code:) (\d+)", str(err))      # "No space left on device (os error 28)"
        number = int(code.group(1)) if code else errno.EIO
        raise OSError(number, os.strerror(number), str(file)) from err


def _save_pretrained(model, tokenizer, path: Path) -> None:
    """save_pretrained, a safetensors error raised as an OSError naming `path`'s model.safetensors."""
    with _naming(path / "model.safetensors"):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)


def adapter_path(path, lora_rank: int) -> Path | None:
    """Where `export_policy(..., path)` saves a LoRA run's peft adapter (None without LoRA)."""
    return Path(path) / ADAPTER if lora_rank else None


def _save_adapter(peft_model, adapter: dict, path: Path) -> None:
    """peft's `save_pretrained` of the whole gathered adapter (a sharded model's own tensors are shards)."""
    with _naming(path / "adapter_model.safetensors"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # peft calls a transformers method deprecated in 5.x
        peft_model.save_pretrained(path, state_dict=adapter)


def export_policy(actor, lora_scaling: float | None, tokenizer, path,
                  ctx: DistContext) -> Path | None:
    """Gather the policy layer by layer (LoRA merged into the base) and save it on rank 0 in Hugging Face format.

    Every rank must call it (the gathers are collectives); rank 0 writes `path` atomically and
    returns it, the others return None; a failed write (a full disk) is raised on every rank.
    `AutoModelForCausalLM.from_pretrained(path)` loads it. With LoRA (`lora_scaling` set), the
    adapter alone is saved too, by peft, in `path/adapter/`: `PeftModel.from_pretrained(base,
    path/adapter)` loads it on the base model the run started from.
    """
    mode = "merged" if lora_scaling is not None else "full"
    state, adapter = {}, {}
    for layer in gather_buckets(list(actor.named_weights())):       # one layer at a time
        for name, tensor in engine_tensors(layer, mode, lora_scaling):
            if ctx.is_main:
                state[name] = tensor.detach().to("cpu", copy=True)
        if ctx.is_main and lora_scaling is not None:                 # peft's own names: ...lora_A.default.weight
            adapter.update((name, t.detach().to("cpu", copy=True)) for name, t in engine_tensors(layer, "adapter"))
    path = Path(path)

    def write() -> Path:                                   # rank 0: a temporary directory, renamed when whole
        base = actor.module.get_base_model() if hasattr(actor.module, "get_base_model") else actor.module
        model = AutoModelForCausalLM.from_config(base.config)
        model.load_state_dict(state, strict=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            _save_pretrained(model, tokenizer, tmp)
            if adapter:
                _save_adapter(actor.module, adapter, tmp / ADAPTER)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with deferred_signals():
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        return path

    return agree(f"writing {path}", write if ctx.is_main else lambda: None)
