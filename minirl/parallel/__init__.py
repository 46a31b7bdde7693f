# Generated from notebooks/04_fsdp_lora.py, notebooks/08_moe_pipelines.py
# by tools/build.py -- edit the notebook, not this file.
"""minirl.parallel."""
