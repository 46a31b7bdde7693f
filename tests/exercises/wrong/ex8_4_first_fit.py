"""Exercise 8.4, wrong: puts each sequence in the first bin it fits (first-fit), not the tightest."""

import importlib.util
from pathlib import Path

EXERCISE = "8.4"
_spec = importlib.util.spec_from_file_location("_packing", Path(__file__).with_name("_packing.py"))
_packing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_packing)


def best_fit_decreasing(lengths, budget):
    return _packing.fit(lengths, budget, lambda fits, room: fits[0])
