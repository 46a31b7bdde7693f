# Generated from notebooks/02_mismatch.py by tools/build.py -- edit the notebook, not this file.
"""minirl.diagnostics."""
