# Generated from notebooks/07_async.py by tools/build.py -- edit the notebook, not this file.
"""minirl.asyncrl."""
