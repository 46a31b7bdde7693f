# Generated from notebooks/03_training_memory.py by tools/build.py -- edit the notebook, not this file.
"""minirl.memory."""
