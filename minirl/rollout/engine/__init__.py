# Generated from notebooks/05_generation_speed.py by tools/build.py -- edit the notebook, not this file.
"""minirl.rollout.engine."""
