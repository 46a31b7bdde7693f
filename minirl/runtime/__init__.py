"""minirl.runtime: hand-written plumbing the lessons call but do not teach (listed in tools/build.py's HAND_WRITTEN)."""
