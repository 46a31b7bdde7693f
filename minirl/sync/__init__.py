# Generated from notebooks/02_mismatch.py, notebooks/04_fsdp_lora.py, notebooks/06_ray_controller.py
# by tools/build.py -- edit the notebook, not this file.
"""minirl.sync."""
