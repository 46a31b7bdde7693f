# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""How a weight sync hands a policy to the engine (`ShardedSync`, `--sync-mode`): no imports."""

__all__ = ["SYNC_MODES"]

SYNC_MODES = ("full", "merged", "adapter")   # every tensor; W + (alpha / r) B A; A and B only
