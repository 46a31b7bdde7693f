"""Exercise 5.4, wrong: draws the token after k accepted drafts from p_k
(the index clamped into q's k positions) instead of p_{k+1}."""

import importlib.util
from pathlib import Path

EXERCISE = "5.4"
_spec = importlib.util.spec_from_file_location("_engine", Path(__file__).with_name("_engine.py"))
_engine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_engine)


def accept_draft(p, q, draft, generator=None):
    return _engine.accept(p, q, draft, generator, bonus="p_k")
