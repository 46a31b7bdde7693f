# Generated from notebooks/01_single_process.py by tools/build.py -- edit the notebook, not this file.
"""minirl.roles."""
