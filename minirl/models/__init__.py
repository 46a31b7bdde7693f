# Generated from notebooks/00_task_and_policy.py, notebooks/02_mismatch.py, notebooks/08_moe_pipelines.py
# by tools/build.py -- edit the notebook, not this file.
"""minirl.models."""
