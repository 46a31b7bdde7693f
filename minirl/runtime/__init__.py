"""minirl.runtime: hand-written plumbing that teaches nothing about RL at scale (tools/build.py's HAND_WRITTEN)."""
