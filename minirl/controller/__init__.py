# Generated from notebooks/06_ray_controller.py by tools/build.py -- edit the notebook, not this file.
"""minirl.controller."""
