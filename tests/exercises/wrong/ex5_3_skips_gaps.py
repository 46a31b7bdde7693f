"""Exercise 5.3, wrong: skips a missing block and keeps matching after it (a prefix with a hole)."""

import importlib.util
from pathlib import Path

EXERCISE = "5.3"
_spec = importlib.util.spec_from_file_location("_engine", Path(__file__).with_name("_engine.py"))
_engine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_engine)


def match_prefix(tokens, block_size, table):
    return _engine.match(tokens, block_size, table, stop=False)
