# Generated from notebooks/09_bottleneck.py by tools/build.py -- edit the notebook, not this file.
"""minirl.profiling."""
