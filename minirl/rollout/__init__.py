# Generated from notebooks/01_single_process.py, notebooks/04_fsdp_lora.py, notebooks/05_generation_speed.py
# by tools/build.py -- edit the notebook, not this file.
"""minirl.rollout."""
