# Generated from notebooks/01_single_process.py, notebooks/02_mismatch.py
# by tools/build.py -- edit the notebook, not this file.
"""minirl.train."""
