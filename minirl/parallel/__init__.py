<<<<<<< HEAD
# Generated from notebooks/08_moe_pipelines.py by tools/build.py -- edit the notebook, not this file.
=======
# Generated from notebooks/04_fsdp_lora.py by tools/build.py -- edit the notebook, not this file.
>>>>>>> 67b5649 (Stage 4 package (WIP): parallel launch/config/wrap/roles/spmd/checkpoint, sharded sync, colocated and vLLM engines, memory tracking; notebook 03 measures with parallel.wrap; chapter 04; tests)
"""minirl.parallel."""
