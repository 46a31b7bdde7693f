"""Exercise 5.4's statistical check: far from a wrong rule, and not failing a correct one by bad luck.

That every check fails its wrong versions is tested in tests/exercises/test_wrong_versions.py
(the wrong versions are tests/exercises/wrong/ex5_*.py).
"""

import importlib.util
from pathlib import Path

import pytest

from minirl.rollout.engine.speculative import accept_draft

HERE = Path(__file__).parent


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checks = load(HERE / "exercises" / "test_05_generation_speed.py", "checks05")


@pytest.mark.parametrize("path", sorted((HERE / "exercises" / "wrong").glob("ex5_4_*.py")), ids=lambda p: p.stem)
def test_a_wrong_rule_is_rejected_by_far(path):
    """By one of the two statistical checks: the joint of the first tokens, or the bonus token alone."""
    accept = load(path, path.stem).accept_draft
    assert min(checks.bigram_pvalue(accept), checks.bonus_pvalue(accept)) < 1e-6, "rejected by far, not by luck"


@pytest.mark.parametrize("test", ["bigram_pvalue", "bonus_pvalue"])
def test_a_correct_rule_passes_on_other_seeds(test):
    """The check's false-failure rate: p-values of the reference spread over (0, 1) from seed to seed."""
    pvalues = [getattr(checks, test)(accept_draft, n=2000, seed=s) for s in range(5)]
    assert min(pvalues) > 1e-3 and max(pvalues) > 0.2, pvalues
