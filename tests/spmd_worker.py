"""A torchrun job for tests/test_parallel_torchrun.py: stage-4 cases on the tiny policy, one job for many cases.

    torchrun --nproc-per-node 2 tests/spmd_worker.py CASES.json OUT_DIR

CASES.json maps a name to a case; rank 0 saves OUT_DIR/<name>.pt. Kinds of case:
  "train" (default): {"rl": RLConfig leaves, "parallel": ParallelConfig fields, "steps": k}
      -> the records and the trainer's full weights after k steps of `spmd_step`;
  "setup_error": the same settings, expected to fail in `setup_spmd`
      -> every rank's error (each rank records what it raised, through `agree`);
  "push_error": a good setup, then a push with {"sabotage": "rename" | "drop" | "older"}
      -> every rank's error;
  "sync_peak": the gathered bytes alive at once when pushing into a streaming engine (one all-gather per
      tensor, packed per layer, packed in one bucket) and into notebook 01's HFEngine (which builds a dict
      of everything), and a layer's and the model's bytes;
  "packed_gather": packed gathering against DTensor.full_tensor, tensor by tensor, and how many
      all-gathers each way makes;
  "sync_every": a run with sync_every=2: the engine's weights after a step that did not push (still the
      initial ones) and after the last step (the trainer's), and the records.
"""

import importlib.util
import json
import sys
from pathlib import Path

import torch

from minirl.config import RLConfig
from minirl.parallel.config import ParallelConfig
from minirl.parallel.launch import init_distributed, shutdown
from minirl.parallel.spmd import setup_spmd, spmd_step
from minirl.rollout.colocated import ColocatedEngine
from minirl.rollout.hf import HFEngine
from minirl.runtime.buckets import gather_buckets, split_by_layer
from minirl.runtime.ranks import agree
from minirl.sync.sharded import ShardedSync, full_tensor
from minirl.tasks.arithmetic import make_task
from minirl.train.run import run


def _tests_conftest():
    """tests/conftest.py by its path (under pytest, the name `conftest` may be another directory's)."""
    path = Path(__file__).resolve().parent / "conftest.py"
    spec = importlib.util.spec_from_file_location("minirl_tests_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_tiny_policy = _tests_conftest().build_tiny_policy


def low_digits(prompts, completions, **columns) -> list[float]:
    """A reward the untrained tiny policy can earn: the share of its characters that are digits 0-4."""
    return [sum(c in "01234" for c in text) / max(1, len(text)) for text in completions]


def sabotaged(named, how: str):
    named = list(named)
    if how == "rename":
        return [(n.replace("mlp.up_proj", "mlp.up"), t) for n, t in named]
    if how == "drop":
        return [(n, t) for n, t in named if not n.endswith("model.norm.weight")]
    return named


def errors_on_every_rank(ctx, fn) -> list:
    """Run fn() through `agree`; each rank's error as "Type: message" (None if it passed), gathered."""
    try:
        agree("a test case", fn)
        error = None
    except Exception as err:                               # recorded for the test to check
        error = f"{type(err).__name__}: {err}"
    errors = [None] * ctx.world_size
    torch.distributed.all_gather_object(errors, error)
    return errors


def engine_weights(state) -> dict:
    return {n: t.detach().clone() for n, t in state.engine.named_weights()}


def trainer_weights(state) -> dict:
    return {n: full_tensor(t).clone() for n, t in state.roles.actor.named_weights()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def packed_against_full_tensor(state) -> dict:
    """Gather the trainer's state per tensor and packed (per layer, one bucket); count the all-gathers."""
    import torch.distributed as dist

    named = list(state.roles.actor.named_weights())
    calls, original = [0], dist.all_gather_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    reference = {n: full_tensor(t) for n, t in named}
    found = {}
    dist.all_gather_single = counted
    try:
        for cap in (0, 2**30):
            calls[0] = 0
            got = {n: t for layer in gather_buckets(named, cap) for n, t in layer}
            found[cap] = {"equal": same(got, reference), "calls": calls[0],
                          "shapes": all(got[n].shape == reference[n].shape for n in reference)}
    finally:
        dist.all_gather_single = original
    uneven = [n for n, t in named if hasattr(t, "to_local") and t.shape[0] % dist.get_world_size()]
    return {"per_layer": found[0], "one_bucket": found[2**30], "layers": len(list(split_by_layer(named))),
            "uneven": uneven, "tensors": len(named)}


def main(cases_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(cases_path).read_text())
    ctx = init_distributed()
    rows = make_task().rows("train")
    try:
        for name, case in cases.items():
            kind = case.get("kind", "train")
            model, tokenizer = build_tiny_policy(seed=case.get("seed", 1), num_layers=case.get("layers", 2))
            config = RLConfig.from_flat(**case.get("rl", {}))
            pconfig = ParallelConfig(**case.get("parallel", {}))
            result = {}
            if kind == "setup_error":
                result["errors"] = errors_on_every_rank(
                    ctx, lambda: setup_spmd(config, pconfig, model, tokenizer, rows, [low_digits], ctx))  # noqa: B023 (called at once)
            elif kind == "sync_peak":
                streaming = ColocatedEngine(HFEngine(model, tokenizer), colocate=False)
                plain = HFEngine(model, tokenizer)
                distinct = {t.data_ptr(): t for t in model.state_dict().values()}.values()     # tied: once
                whole = sum(t.numel() * t.element_size() for t in distinct)
                layer = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if ".layers.0." in n)
                state = setup_spmd(config, pconfig, model, tokenizer, rows, [low_digits], ctx)
                named = list(state.roles.actor.named_weights())
                per_tensor, per_layer = ShardedSync("full", packed=False), ShardedSync("full", bucket_bytes=0)
                result = {"streaming": per_tensor.push(named, streaming, 1).peak_bytes,
                          "packed_layer": per_layer.push(named, streaming, 2).peak_bytes,
                          "packed_bucket": ShardedSync("full", bucket_bytes=2**30).push(named, streaming, 3).peak_bytes,
                          "dict": per_tensor.push(named, plain, 1).peak_bytes, "layer": layer, "whole": whole}
            elif kind == "packed_gather":
                result = packed_against_full_tensor(setup_spmd(config, pconfig, model, tokenizer, rows, [low_digits],
                                                               ctx))
            elif kind == "sync_every":
                state = setup_spmd(config, pconfig, model, tokenizer, rows, [low_digits], ctx)
                initial = engine_weights(state)
                run(state, spmd_step, [], 1)
                after_one, trainer_one = engine_weights(state), trainer_weights(state)
                records = run(state, spmd_step, [], case["steps"])
                result = {"records": records, "stale_after_one": same(after_one, initial),
                          "trained_after_one": not same(trainer_one, initial),
                          "fresh_at_end": same(engine_weights(state), trainer_weights(state))}
            else:
                state = setup_spmd(config, pconfig, model, tokenizer, rows, [low_digits], ctx)
                if kind == "push_error":
                    version = 0 if case["sabotage"] == "older" else 1
                    if version == 0:
                        state.sync.push(state.roles.actor.named_weights(), state.engine, 3)
                    result["errors"] = errors_on_every_rank(ctx, lambda: state.sync.push(  # noqa: B023 (called at once)
                        sabotaged(state.roles.actor.named_weights(), case["sabotage"]), state.engine, version))  # noqa: B023 (called at once)
                else:
                    result["records"] = run(state, spmd_step, [], case["steps"])
                    result["weights"] = {n: full_tensor(t).clone() for n, t in state.roles.actor.named_weights()}
            if ctx.is_main:
                torch.save(result, Path(out_dir) / f"{name}.pt")
    finally:
        shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
