# Generated from notebooks/00_task_and_policy.py by tools/build.py -- edit the notebook, not this file.
"""minirl.tasks."""
