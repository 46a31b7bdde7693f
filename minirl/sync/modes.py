# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
"""The ways a weight sync can hand a policy to the engine: all of its weights, LoRA merged in, or the adapter alone.

`SYNC_MODES` names them once for `minirl.sync.sharded.ShardedSync`, which implements them, and
for stage 4's `--sync-mode` flag, which lists them before torch loads (this module imports nothing).
"""

__all__ = ["SYNC_MODES"]

SYNC_MODES = ("full", "merged", "adapter")   # every tensor; W + (alpha / r) B A under the base names; A and B only
