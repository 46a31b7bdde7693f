# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""The ways a weight sync can hand a policy to the engine (`ShardedSync`, `--sync-mode`); imports nothing."""

__all__ = ["SYNC_MODES"]

SYNC_MODES = ("full", "merged", "adapter")   # every tensor; W + (alpha / r) B A under the base names; A and B only
