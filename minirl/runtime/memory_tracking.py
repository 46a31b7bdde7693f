"""Memory of a live data-parallel run, per rank, counted as notebook 03 counts it (a measurement harness).

`trainer_bytes` splits what a rank's actor holds into weights (local shards), gradients and
optimizer state; `engine_bytes` counts the engine's weights (0 while a colocated engine
sleeps). `MemoryTracker` is a run callback: a forward hook on the actor samples the rank's
total right after the update's forward pass (gathered FSDP2 weights, last step's gradients,
Adam, the engine, asleep if colocated), the end of each step samples it at rest (engine
awake after the sync), and every rank's figures are gathered into the record (lists, one
entry per rank): "memory/update_bytes" (the sample in the update), "memory/rest_bytes" (at
rest), "memory/peak_bytes" (the larger), "memory/state_bytes", "memory/{weights,grads,
optimizer}_bytes", "memory/engine_awake_bytes", "memory/engine_asleep_bytes", and on CUDA
"memory/cuda_peak_bytes".

Simplified: storage counting sees named tensors only (no activations or buffers); the CUDA
allocator's peak is the ground truth where there is one.
"""

import torch
import torch.distributed as dist

from minirl.memory.measure import storage_bytes
from minirl.train.run import Callback


def _optimizer_tensors(actor) -> list:
    optimizer = actor.optimizer.optim if hasattr(actor.optimizer, "optim") else actor.optimizer   # ZeRO-1 wraps one
    return [v for per_param in optimizer.state.values() for v in per_param.values() if torch.is_tensor(v)]


def trainer_bytes(actor) -> dict[str, int]:
    """{"weights", "grads", "optimizer"}: storage bytes this rank's actor holds at rest (DTensor shards locally)."""
    params = list(actor.model.parameters())
    return {"weights": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
            "optimizer": storage_bytes(_optimizer_tensors(actor))}


def engine_bytes(engine) -> int:
    """Bytes of the engine's weights as it holds them now (vLLM: its device memory, from mem_get_info)."""
    if hasattr(engine, "memory_bytes"):
        return engine.memory_bytes()
    try:
        return storage_bytes(t for _, t in engine.named_weights())
    except NotImplementedError:
        return 0


class MemoryTracker(Callback):
    """Per-rank memory of every step, in the record (lists indexed by rank). Every rank must run it."""

    def __init__(self):
        self.hook, self.shards, self.update, self.asleep = None, [], 0, 0

    def _sample(self, state, registered) -> int:
        """This rank's bytes now: shards + the parameters registered now + gradients + Adam + the engine."""
        grads = [p.grad for p in self.shards]
        tensors = [*self.shards, *registered, *grads, *_optimizer_tensors(state.roles.actor)]
        return storage_bytes(tensors) + engine_bytes(state.engine)

    def on_start(self, state):
        module = state.roles.actor.module
        self.shards = list(module.parameters())          # at rest: what the rank owns

        def after_forward(mod, args, output):            # FSDP2 has swapped gathered tensors in
            if torch.is_grad_enabled():
                self.update = max(self.update, self._sample(state, list(module.parameters())))
                self.asleep = engine_bytes(state.engine)

        self.hook = module.register_forward_hook(after_forward)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_step(self, state, record):
        parts = trainer_bytes(state.roles.actor)
        awake = engine_bytes(state.engine)
        rest = self._sample(state, [])
        mine = {"update": self.update, "rest": rest, "peak": max(self.update, rest), "state": sum(parts.values()),
                "awake": awake, "asleep": self.asleep, **parts}
        if torch.cuda.is_available():
            mine["cuda_peak"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        for key in ("update", "rest", "peak"):
            record[f"memory/{key}_bytes"] = [m[key] for m in everyone]
        record["memory/state_bytes"] = [m["state"] for m in everyone]
        record["memory/engine_awake_bytes"] = [m["awake"] for m in everyone]
        record["memory/engine_asleep_bytes"] = [m["asleep"] for m in everyone]
        for part in ("weights", "grads", "optimizer"):
            record[f"memory/{part}_bytes"] = [m[part] for m in everyone]
        if "cuda_peak" in mine:
            record["memory/cuda_peak_bytes"] = [m["cuda_peak"] for m in everyone]
        self.update = 0

    def on_end(self, state):
        if self.hook is not None:
            self.hook.remove()
