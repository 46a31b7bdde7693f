"""Tests of tools/build.py on small notebook trees built in tmp_path."""

import ast
import contextlib
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("minirl_tools_build", REPO / "tools" / "build.py")
build_tool = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = build_tool  # dataclasses look their module up here
_spec.loader.exec_module(build_tool)
build = build_tool.build
BuildError = build_tool.BuildError
BuildWarning = build_tool.BuildWarning


def make_tree(root: Path, notebooks: dict[str, str]) -> Path:
    """A repo with minirl/__init__.py and the given notebooks/<name>.py (dedented) sources."""
    (root / "notebooks").mkdir(parents=True, exist_ok=True)
    (root / "minirl").mkdir(exist_ok=True)
    (root / "minirl" / "__init__.py").write_text('"""minirl."""\n')
    for name, source in notebooks.items():
        (root / "notebooks" / name).write_text(textwrap.dedent(source).lstrip())
    return root


@contextlib.contextmanager
def another_minirl(root: Path):
    """Import the `minirl` generated under `root`, then put the real package's modules back as they were.

    Popping the real modules and importing them anew would leave two copies of every class
    (an `isinstance` check against the new `SamplingConfig` fails on objects made from the old one).
    """
    ours = {n: m for n, m in sys.modules.items() if n == "minirl" or n.startswith("minirl.")}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n == "minirl" or n.startswith("minirl.")]:
            del sys.modules[name]
        sys.modules.update(ours)


def read(root: Path, rel: str) -> str:
    return (root / rel).read_text()


TASKS_A = '''
    # %% [markdown]
    # # Tasks
    # Some prose with `# | export minirl/nope.py` inside markdown: ignored.

    # %%
    # | export minirl/tasks.py
    """Tasks: prompts with checkable answers."""
    from __future__ import annotations

    import os
    from dataclasses import (
        dataclass,
        field,
    )


    @dataclass
    class Task:
        prompt: str
        tags: list = field(default_factory=list)

    # %%
    task = Task("1+1")
    task

    # %%
    #| export minirl/tasks.py
    import os
    import random

    from minirl.util import seeded


    def sample(tasks):
        """Pick one task."""
        return random.choice(tasks)
'''

TASKS_B = '''
    # %%
    # | export minirl/tasks.py
    import json

    def load(path):
        """Read tasks from a json file."""
        try:
            import gzip
        except ImportError:
            gzip = None
        return json.loads(open(path).read())

    # %%
    # | export minirl/util.py
    """Small helpers."""

    import random

    SEED = 0


    def seeded(seed=SEED):
        return random.Random(seed)
'''


@pytest.fixture
def two_notebooks(tmp_path):
    root = make_tree(tmp_path, {"00_tasks.py": TASKS_A, "01_more.py": TASKS_B})
    build(root, check=False)
    return root


def test_module_layout_order_and_hoisting(two_notebooks):
    text = read(two_notebooks, "minirl/tasks.py")
    assert text == (
        "# Generated from notebooks/00_tasks.py, notebooks/01_more.py by tools/build.py -- edit the notebook, "
        "not this file.\n") + textwrap.dedent('''\
        """Tasks: prompts with checkable answers."""

        from __future__ import annotations

        __all__ = ["Task", "sample", "load"]

        import json
        import os
        import random
        from dataclasses import (
            dataclass,
            field,
        )

        from minirl.util import seeded


        @dataclass
        class Task:
            prompt: str
            tags: list = field(default_factory=list)


        def sample(tasks):
            """Pick one task."""
            return random.choice(tasks)


        def load(path):
            """Read tasks from a json file."""
            try:
                import gzip
            except ImportError:
                gzip = None
            return json.loads(open(path).read())
        ''')
    assert "task = Task" not in text  # cells without the marker stay in the notebook
    assert not (two_notebooks / "minirl" / "nope.py").exists()


def test_notebook_exporting_to_two_modules(two_notebooks):
    util = read(two_notebooks, "minirl/util.py")
    assert util.startswith(
        "# Generated from notebooks/01_more.py by tools/build.py -- edit the notebook, not this file.\n"
        '"""Small helpers."""\n\n__all__ = ["SEED", "seeded"]\n\nimport random\n\nSEED = 0\n\n\ndef seeded'
    )
    assert util.endswith("return random.Random(seed)\n")
    # the generated package imports
    with another_minirl(two_notebooks):
        import minirl.tasks

        assert minirl.tasks.sample([minirl.tasks.Task("a")]).prompt == "a"


def test_future_import_from_a_later_cell_goes_first(tmp_path):
    source = """
        # %%
        # | export minirl/x.py
        \"\"\"X.\"\"\"
        import os
        from minirl import tasks
        A = os.sep

        # %%
        # | export minirl/x.py
        from __future__ import annotations
        import os
        import minirl.util as util
        import sys
        B = sys.path
    """
    root = make_tree(tmp_path, {"00_x.py": source})
    build(root, check=False)
    assert read(root, "minirl/x.py").split("\n", 1)[1] == (
        '"""X."""\n\nfrom __future__ import annotations\n\n__all__ = ["A", "B"]\n\nimport os\nimport sys\n\n'
        "import minirl.util as util\nfrom minirl import tasks\n\nA = os.sep\n\n\nB = sys.path\n"
    )


def test_missing_module_docstring(tmp_path):
    root = make_tree(tmp_path, {"00_x.py": "# %%\n# | export minirl/x.py\nimport os\nX = 1\n"})
    with pytest.raises(BuildError, match=r"notebooks/00_x.py:\d+: minirl/x.py: the first exported cell must start"):
        build(root, check=False)


def test_bad_target(tmp_path):
    root = make_tree(tmp_path, {"00_x.py": '# %%\n\n# | export lib/x.py\n"""Doc."""\n'})
    with pytest.raises(BuildError, match=r"notebooks/00_x.py:3: export target must be a .py file under minirl/"):
        build(root, check=False)


@pytest.mark.parametrize("line", ["print(x)", "x", "plt.plot(x)", "display(x)"])
def test_debris_rejected(tmp_path, line):
    root = make_tree(tmp_path, {"00_x.py": f'# %%\n# | export minirl/x.py\n"""Doc."""\nx = 1\n{line}\n'})
    with pytest.raises(BuildError, match=r"notebooks/00_x.py:5: exported cells hold package code only"):
        build(root, check=False)


POLICY = '''
    # %%
    # | export minirl/policy.py
    """Policies that act on tasks."""

    import math


    class Policy:
        def act(self, x):
            """Return 2 * x."""
            # BEGIN SOLUTION
            y = 2 * x
            return y
            # END SOLUTION

    # %%
    # | export minirl/policy.py
    def softmax(xs):
        """Return the softmax of xs."""
        m = max(xs)
        # BEGIN SOLUTION
        es = [math.exp(x - m) for x in xs]
        # END SOLUTION
        return [e / sum(es) for e in es]

    # BEGIN SOLUTION
    TABLE = {}
    # END SOLUTION
'''


def test_solutions_kept_in_package(tmp_path):
    root = make_tree(tmp_path, {"03_policy.py": POLICY})
    build(root, check=False)
    text = read(root, "minirl/policy.py")
    assert "SOLUTION" not in text
    assert "        y = 2 * x\n        return y\n" in text
    assert "es = [math.exp(x - m) for x in xs]" in text
    # notebook keeps its markers
    assert "# BEGIN SOLUTION" in read(root, "notebooks/03_policy.ipynb")


def test_exercises_stubbed(tmp_path):
    root = make_tree(tmp_path, {"03_policy.py": POLICY, "04_none.py": '# %%\n# | export minirl/b.py\n"""B."""\n'})
    build(root, check=False)
    assert not (root / "exercises" / "04_none.py").exists()  # no solutions, no exercises
    text = read(root, "exercises/03_policy.py")
    assert text.startswith(
        "# Exercises of notebooks/03_policy.py, generated by tools/build.py -- fill in the stubs, then grade:\n"
        "#     python -m minirl.grade --only 03\n"
        '"""Exercises for notebook 03: Policies that act on tasks.\n\n'
        "Each `raise NotImplementedError` marks code to write; the docstring above it says what to return.\n"
        "Only the notebook's cells that hold exercises are here; the rest of its code is in minirl,\n"
        "imported below where these cells use it.\n"
        '"""\n\nimport math\n'
    )
    assert "SOLUTION" not in text and "y = 2 * x" not in text and "math.exp" not in text
    assert (
        '    def act(self, x):\n        """Return 2 * x."""\n'
        '        raise NotImplementedError("exercise 3.1: act -- see its docstring and notebook 03")\n'
    ) in text
    assert '    raise NotImplementedError("exercise 3.2: softmax -- see its docstring and notebook 03")\n' in text
    assert '\nraise NotImplementedError("exercise 3.3: module level -- see its docstring and notebook 03")\n' in text
    compile(text, "exercises/03_policy.py", "exec")
    # import the stubs without the module-level one, and call them
    namespace = {}
    exec(compile(text.replace('\nraise NotImplementedError("exercise 3.3', '\nNone and ("'), "ex", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="exercise 3.1: act"):
        namespace["Policy"]().act(1)
    with pytest.raises(NotImplementedError, match="exercise 3.2: softmax"):
        namespace["softmax"]([1.0])


@pytest.mark.parametrize(
    "cell, line",
    [
        ("def f():\n    # BEGIN SOLUTION\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n", 6),
        ("def f():\n    return 1\n    # END SOLUTION\n", 6),
        ("def f():\n    # BEGIN SOLUTION\n    return 1\n", 5),
    ],
)
def test_unbalanced_solution_markers(tmp_path, cell, line):
    root = make_tree(tmp_path, {"00_x.py": f'# %%\n# | export minirl/x.py\n"""Doc."""\n{cell}'})
    with pytest.raises(BuildError, match=rf"notebooks/00_x.py:{line}: "):
        build(root, check=False)


def test_check_mode(two_notebooks):
    root = two_notebooks
    assert build(root, check=True) == []
    assert build(root, check=False) == []  # nothing to rewrite
    (root / "minirl" / "tasks.py").write_text(read(root, "minirl/tasks.py") + "# hand edit\n")
    (root / "notebooks" / "01_more.ipynb").unlink()
    before = read(root, "minirl/tasks.py")
    problems = build(root, check=True)
    assert problems == ["minirl/tasks.py: differs", "notebooks/01_more.ipynb: missing"]
    assert read(root, "minirl/tasks.py") == before  # check writes nothing
    assert build(root, check=False) == ["minirl/tasks.py: written", "notebooks/01_more.ipynb: written"]
    assert build(root, check=True) == []


def test_check_cli(two_notebooks):
    tool = REPO / "tools" / "build.py"
    def run(*args):
        return subprocess.run([sys.executable, str(tool), "--root", str(two_notebooks), *args],
                              capture_output=True, text=True)

    ok = run("--check")
    assert ok.returncode == 0 and "in sync (" in ok.stdout
    (two_notebooks / "minirl" / "util.py").write_text("# Generated from notebooks/01_more.py\n")
    bad = run("--check")
    assert bad.returncode == 1
    assert "minirl/util.py: differs" in bad.stdout
    assert "notebooks and package out of sync: run python tools/build.py" in bad.stdout
    assert run().returncode == 0 and run("--check").returncode == 0


def test_stale_and_unlisted(two_notebooks):
    root = two_notebooks
    # drop the cell exporting to minirl/util.py (and the import that needs it)
    nb = root / "notebooks" / "01_more.py"
    nb.write_text(nb.read_text().split("# %%\n# | export minirl/util.py")[0])
    a = root / "notebooks" / "00_tasks.py"
    a.write_text(a.read_text().replace("from minirl.util import seeded\n", ""))
    (root / "minirl" / "helper.py").write_text('"""Written by hand."""\n')
    (root / "minirl" / "grade.py").write_text('"""Listed in HAND_WRITTEN."""\n')
    problems = build(root, check=True)
    assert "minirl/util.py: " + build_tool.STALE in problems
    assert "minirl/helper.py: " + build_tool.UNLISTED in problems
    assert not any(p.startswith("minirl/grade.py") for p in problems)
    assert (root / "minirl" / "util.py").exists()
    changes = build(root, check=False)
    assert "minirl/util.py: deleted (stale)" in changes
    assert not (root / "minirl" / "util.py").exists()
    assert (root / "minirl" / "helper.py").exists()  # hand-written files are never deleted
    assert build(root, check=True) == ["minirl/helper.py: " + build_tool.UNLISTED]


def test_refuses_to_overwrite_hand_written(tmp_path):
    root = make_tree(tmp_path, {"00_x.py": '# %%\n# | export minirl/grade.py\n"""Doc."""\n'})
    with pytest.raises(BuildError, match="hand-written"):
        build(root, check=False)


def test_long_header_wrapped(tmp_path):
    cell = '# %%\n# | export minirl/a_rather_long_package/x.py\n"""X."""\nX = 1\n'
    root = make_tree(tmp_path, {"00_a_notebook_with_a_long_name.py": cell, "01_and_another_long_one.py": cell})
    build(root, check=False)
    for rel in ("minirl/a_rather_long_package/x.py", "minirl/a_rather_long_package/__init__.py"):
        text = read(root, rel)
        assert text.startswith("# Generated from notebooks/00_a_notebook_with_a_long_name.py, "
                               "notebooks/01_and_another_long_one.py\n# by tools/build.py -- edit the notebook, "
                               "not this file.\n"), text
        assert max(map(len, text.splitlines())) <= 120, "generated lines fit ruff's line length"
    assert build(root, check=True) == [], "a wrapped header is still recognized as generated"


def test_subpackage_marker(tmp_path):
    root = make_tree(tmp_path, {"05_hf.py": '# %%\n# | export minirl/rollout/toy.py\n"""HF rollout."""\nX = 1\n'})
    build(root, check=False)
    assert read(root, "minirl/rollout/__init__.py") == (
        "# Generated from notebooks/05_hf.py by tools/build.py -- edit the notebook, not this file.\n"
        '"""minirl.rollout."""\n'
    )
    assert build(root, check=True) == []


def test_ipynb_clean_and_deterministic(two_notebooks):
    import nbformat

    first = (two_notebooks / "notebooks" / "00_tasks.ipynb").read_bytes()
    nb = nbformat.reads(first.decode(), as_version=4)
    nbformat.validate(nb)
    assert nb.metadata == {**build_tool.PAIRING, **build_tool.KERNEL}
    assert [c.id for c in nb.cells] == ["c000", "c001", "c002", "c003"]
    assert [c.cell_type for c in nb.cells] == ["markdown", "code", "code", "code"]
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    assert nb.cells[1].source.startswith("# | export minirl/tasks.py\n")
    (two_notebooks / "notebooks" / "00_tasks.ipynb").unlink()
    build(two_notebooks, check=False)
    assert (two_notebooks / "notebooks" / "00_tasks.ipynb").read_bytes() == first
    assert first.endswith(b"}\n")


@pytest.mark.skipif(
    not list((REPO / "notebooks").glob("[0-9][0-9]_*.py")), reason="no notebooks in the repo yet"
)
def test_repo_in_sync():
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "build.py"), "--check"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- generated modules read like hand-written ones


def test_blank_line_runs_collapsed(tmp_path):
    nl = "\n"
    source = (
        '# %%\n# | export minirl/x.py\n"""X."""\nimport os\n\n\n\n\nA = 1\n\n\n\n\n'
        "def f():\n    x = 1\n\n\n\n    return x\n\n\n\n\nclass C:\n    def a(self):\n        return 1\n"
        "    \n  \n\n    def b(self):\n        return '''keep\n\n\n\nme'''\n"
        "\n\n\n\n# %%\n# | export minirl/x.py\nimport os\n\n\n\n\nB = 2\n"
    )
    root = make_tree(tmp_path, {"00_x.py": source})
    build(root, check=False)
    assert read(root, "minirl/x.py").split(nl, 1)[1] == (
        '"""X."""\n\n__all__ = ["A", "f", "C", "B"]\n\nimport os\n\n'
        "A = 1\n\n\n"                           # four blank lines cut to two at top level
        "def f():\n    x = 1\n\n    return x\n\n\n"  # three cut to one inside a block
        "class C:\n    def a(self):\n        return 1\n\n"  # whitespace-only lines are blank lines
        "    def b(self):\n        return '''keep\n\n\n\nme'''\n\n\n"  # a string's lines are its value
        "B = 2\n"                               # the hoisted import's blank lines are gone too
    )


def test_all_lists_public_names_in_order(tmp_path):
    source = '''
        # %%
        # | export minirl/x.py
        """X."""
        from __future__ import annotations
        import os
        from typing import Callable
        MAX_LEN = 4
        _PRIVATE = 1
        lower = 2
        Reward = Callable[[str], float]
        LIMITS: tuple = (1, 2)
        UNSET: int
        LOW, HIGH = 0.8, 1.2


        def helper():
            INNER = 3
            return INNER


        def _private():
            pass


        class Thing:
            NAME = "x"

        # %%
        # | export minirl/x.py
        async def fetch():
            pass


        MAX_LEN = 5
    '''
    root = make_tree(tmp_path, {"00_x.py": source})
    build(root, check=False)
    text = read(root, "minirl/x.py")
    names = ["MAX_LEN", "LIMITS", "LOW", "HIGH", "helper", "Thing", "fetch"]
    expected = '"""X."""\n\nfrom __future__ import annotations\n\n__all__ = ' + repr(names).replace("'", '"')
    assert expected + "\n\nimport os\n" in text, \
        "__all__ after __future__ (PEP 8): defs, classes, UPPER_CASE constants, first definition order"
    namespace = {}
    exec(compile(text, "x.py", "exec"), namespace)
    assert namespace["__all__"] == names


def test_all_wraps_long_lists(tmp_path):
    defs = "".join(f"\n\ndef function_number_{i}():\n    pass\n" for i in range(12))
    root = make_tree(tmp_path, {"00_x.py": f'# %%\n# | export minirl/x.py\n"""X."""\n{defs}'})
    build(root, check=False)
    text = read(root, "minirl/x.py")
    block = text.split("__all__ = [", 1)[1].split("]", 1)[0]
    assert "\n" in block and all(len(line) <= 100 for line in text.splitlines())
    namespace = {}
    exec(compile(text, "x.py", "exec"), namespace)
    assert namespace["__all__"] == [f"function_number_{i}" for i in range(12)]


def test_all_written_by_hand_is_an_error(tmp_path):
    root = make_tree(tmp_path, {"00_x.py": '# %%\n# | export minirl/x.py\n"""X."""\n__all__ = ["f"]\n'})
    with pytest.raises(BuildError, match=r"notebooks/00_x.py:\d+: minirl/x.py: the build writes __all__"):
        build(root, check=False)


FUNCTION_IMPORTS = '''
    # %%
    # | export minirl/x.py
    """X."""
    from minirl.top import fine


    def f():
        from minirl.util import seeded
        import minirl.tasks as tasks
        from . import sibling
        from minirl.rollout import (
            engine,
        )
        import json
        return seeded, tasks, sibling, engine, json


    def g():
        from minirl.util import seeded  # lazy: minirl.util imports this module
        from minirl.rollout import (  # avoids a cycle with rollout
            engine,
        )

        def inner():
            from minirl.deep import thing
            return thing
        return seeded, engine, inner
'''


def test_function_level_minirl_import_warns(tmp_path):
    root = make_tree(tmp_path, {"00_x.py": FUNCTION_IMPORTS})
    with pytest.warns(BuildWarning) as caught:
        build(root, check=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, BuildWarning)]
    assert [m.split(": ", 1)[0] for m in messages] == [
        "notebooks/00_x.py:8", "notebooks/00_x.py:9", "notebooks/00_x.py:10", "notebooks/00_x.py:11",
        "notebooks/00_x.py:25"], "\n".join(messages)
    assert "`from minirl.util import seeded` inside f() in minirl/x.py: move it to the top" in messages[0]
    assert "inside inner()" in messages[-1], "an import in a nested function is reported once, for that function"
    assert (root / "minirl" / "x.py").exists(), "a warning, not an error: the module is built"


def test_function_level_import_warning_printed_by_the_cli(tmp_path):
    root = make_tree(tmp_path, {"00_x.py": FUNCTION_IMPORTS})
    out = subprocess.run([sys.executable, str(REPO / "tools" / "build.py"), "--root", str(root)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("warning: notebooks/00_x.py:") == 5, out.stderr
    check = subprocess.run([sys.executable, str(REPO / "tools" / "build.py"), "--root", str(root), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0 and "in sync" in check.stdout, "warnings never fail --check"


def test_no_warning_without_function_level_minirl_imports(two_notebooks):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", BuildWarning)  # TASKS_B's `import gzip` in a function is not minirl's
        build(two_notebooks, check=False)


# ---------------------------------------------------------------- exercise files: the exercise cells only


LIBRARY = '''
    # %% [markdown]
    # # 02 · Losses, by hand

    # %%
    # | export minirl/losses.py
    """Losses."""
    import math
    import json

    SCALE = 2.0


    def helper(x):
        return x * SCALE

    # %%
    # | export minirl/losses.py
    from minirl.stats import mean, clipped, spread
    import collections


    def loss(xs):
        """Mean of helper(x) + clipped(x) over xs (imports `mean`, an answer, without using it)."""
        # BEGIN SOLUTION
        return sum(helper(x) + clipped(x) for x in xs) / len(xs) + math.e * 0
        # END SOLUTION


    def loss_twice(xs):
        return 2 * loss(xs)

    # %%
    # | export minirl/report.py
    """Reports."""
    from minirl.losses import loss


    def report(xs):
        return json.dumps(loss(xs))
'''

STATS = '''
    # %%
    # | export minirl/stats.py
    """Statistics."""


    def mean(xs):
        """Average of xs."""
        # BEGIN SOLUTION
        return sum(xs) / len(xs)
        # END SOLUTION


    def spread(xs):
        return max(xs) - min(xs)


    def clipped(x):
        return min(max(x, -1), 1)
'''


def test_exercise_file_holds_only_the_exercise_cells(tmp_path):
    root = make_tree(tmp_path, {"01_stats.py": STATS, "02_losses.py": LIBRARY})
    build(root, check=False)
    text = read(root, "exercises/02_losses.py")
    head, code = text.split('"""\n\n', 1)
    assert head.endswith("Exercises for notebook 02: Losses, by hand.\n\n"
                         "Each `raise NotImplementedError` marks code to write; the docstring above it says what to "
                         "return.\nOnly the notebook's cells that hold exercises are here; the rest of its code is in "
                         "minirl,\nimported below where these cells use it.\n"), "the title is the notebook's heading"
    assert code.startswith(
        "import collections\nimport math\n\n"
        "from minirl.losses import helper\nfrom minirl.stats import clipped, spread\n\n\n"
        "def loss(xs):\n"), code
    assert "def report" not in code and "SCALE = 2.0" not in code, "cells without solution spans stay in minirl"
    assert "mean" not in code.split("def loss")[0], "mean is exercise 1.1's answer: the stub never imports it"
    assert "import json" not in code, "only what the exercise cells use is imported from other cells"
    assert 'raise NotImplementedError("exercise 2.1: loss -- see its docstring and notebook 02")' in code


def test_exercise_file_drops_imports_of_its_own_names(tmp_path):
    source = '''
        # %%
        # | export minirl/a.py
        """A."""
        from minirl.a import gae, whiten as w, masked_mean
        from minirl.b import only_answer


        def gae(x):
            """GAE."""
            # BEGIN SOLUTION
            return w(masked_mean(x))
            # END SOLUTION


        def whiten(x):
            return x
    '''
    root = make_tree(tmp_path, {"01_a.py": source})
    (root / "minirl" / "b.py").write_text('"""Hand-written in this test."""\n')
    code = build_tool.render_exercises("notebooks/01_a.py", build_tool.read_notebooks(root)[1])
    assert "from minirl.a import whiten as w, masked_mean\nfrom minirl.b import only_answer\n" in code, code
    assert "import gae" not in code and " gae," not in code, "the file defines gae: never import it from minirl"


def test_exercise_needing_another_notebooks_answer_is_an_error(tmp_path):
    uses_mean = STATS.replace("# | export minirl/stats.py", "# | export minirl/stats.py") + '''
    # %%
    # | export minirl/summary.py
    """Summary."""
    from minirl.stats import mean


    def summary(xs):
        """mean and spread."""
        # BEGIN SOLUTION
        return mean(xs), max(xs) - min(xs)
        # END SOLUTION
    '''
    root = make_tree(tmp_path, {"01_stats.py": STATS, "02_summary.py": uses_mean.replace(STATS, "")})
    with pytest.raises(BuildError, match=r"notebooks/02_summary.py:\d+: this cell holds an exercise and uses `mean`, "
                                         r"the answer to exercise 1.1 \(notebooks/01_stats.py:\d+\)"):
        build(root, check=False)


def test_solved_exercise_files_run(tmp_path):
    """With the solutions kept, the exercise file's imports are enough to run it."""
    root = make_tree(tmp_path, {"01_stats.py": STATS, "02_losses.py": LIBRARY})
    build(root, check=False)
    solved = build_tool.exercise_files(build_tool.read_notebooks(root)[1], solutions=True)
    with another_minirl(root):
        namespace = {}
        exec(compile(solved["exercises/02_losses.py"], "02_losses.py", "exec"), namespace)
        assert namespace["loss_twice"]([0.5, 3.0]) == 2 * (1.0 + 0.5 + 6.0 + 1.0) / 2


@pytest.mark.skipif(not list((REPO / "exercises").glob("[0-9][0-9]_*.py")), reason="no exercises in the repo yet")
def test_repo_exercise_files_import_no_answers():
    """No exercises/NN_*.py imports from minirl an exercise's answer or a name it defines itself."""
    import ast
    import re

    paths = sorted((REPO / "exercises").glob("[0-9][0-9]_*.py"))
    stub = re.compile(r'NotImplementedError\("exercise (\d+\.\d+): (\w+) --')
    answers = {name: number for path in paths for number, name in stub.findall(path.read_text())}
    assert {"gae", "group_advantages", "format_answer"} <= set(answers)
    for path in paths:
        tree = ast.parse(path.read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "minirl":
                for alias in node.names:
                    name = alias.asname or alias.name
                    assert name not in answers, f"{path.name} imports {name}, the answer to exercise {answers[name]}"
                    assert name not in defined, f"{path.name} imports {name} from minirl and defines it too"


def test_another_minirl_puts_the_real_package_back(two_notebooks):
    """After a test imports a generated minirl, the real modules are the very same objects (not re-imports)."""
    import minirl.config

    before = minirl.config.SamplingConfig
    with another_minirl(two_notebooks):
        import minirl

        assert Path(minirl.__file__).resolve().parent == (two_notebooks / "minirl").resolve()
    import minirl.config as again

    assert again.SamplingConfig is before


# ---------------------------------------------------------------- the .ipynb is paired with its .py by jupytext

PAIRED = "ipynb,py:percent"


@pytest.fixture
def notebook_pair(tmp_path):
    """A copy of a real notebook pair (notebook 03's .py, its .ipynb as the build writes it) and the folder's config."""
    source = REPO / "notebooks" / "03_training_memory.py"
    py, ipynb = tmp_path / source.name, tmp_path / (source.stem + ".ipynb")
    py.write_bytes(source.read_bytes())
    ipynb.write_text(build_tool.render_ipynb(source.read_text(encoding="utf-8")), encoding="utf-8")
    (tmp_path / "jupytext.toml").write_bytes((REPO / "notebooks" / "jupytext.toml").read_bytes())
    return py, ipynb


def newer(path: Path, seconds: float = 10) -> None:
    """Make `path` look edited `seconds` after the rest of its pair (jupytext reads the newer file's inputs)."""
    import os
    import time

    os.utime(path, (time.time() + seconds, time.time() + seconds))


def body_lines(text: str) -> list[str]:
    """A .py without the lines jupytext stamps into its header on every save (its format and own version)."""
    return [line for line in text.splitlines() if not line.startswith(("#       format_version:",
                                                                       "#       jupytext_version:"))]


def jupytext_sync(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jupytext", "--sync", str(path)], capture_output=True, text=True,
                          cwd=path.parent)


def test_ipynb_carries_jupytext_pairing(notebook_pair):
    import nbformat

    py, ipynb = notebook_pair
    nb = nbformat.read(ipynb, as_version=4)
    assert nb.metadata["jupytext"] == {"formats": PAIRED}
    import jupytext

    assert jupytext.read(py).metadata["jupytext"]["formats"] == PAIRED  # the .py's header says the same


def test_sync_after_editing_the_ipynb_updates_the_py(notebook_pair):
    """What Jupyter's save does, from a shell: an edit in the .ipynb reaches the .py, and nothing else changes."""
    import nbformat

    py, ipynb = notebook_pair
    before = py.read_text(encoding="utf-8")
    nb = nbformat.read(ipynb, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    cell.source += '\nprint("edited in Jupyter")'
    nbformat.write(nb, ipynb)
    newer(ipynb)
    done = jupytext_sync(ipynb)
    assert done.returncode == 0, done.stdout + done.stderr
    after = py.read_text(encoding="utf-8")
    assert 'print("edited in Jupyter")' in after
    added = [line for line in body_lines(after) if line not in body_lines(before)]
    assert added == ['print("edited in Jupyter")']


def test_sync_of_an_unedited_ipynb_leaves_the_py_cells_as_they_were(notebook_pair):
    """The pair round-trips: blank lines between cells survive (the build keeps jupytext's lines_to_next_cell)."""
    py, ipynb = notebook_pair
    before = py.read_text(encoding="utf-8")
    newer(ipynb)
    done = jupytext_sync(ipynb)
    assert done.returncode == 0, done.stdout + done.stderr
    assert body_lines(py.read_text(encoding="utf-8")) == body_lines(before)


def test_jupyter_opens_the_pair_and_saving_the_ipynb_writes_the_py(notebook_pair):
    """Jupyter's jupytext contents manager: a freshly built .ipynb (newer than its .py) opens, saving writes the .py."""
    from jupytext import TextFileContentsManager

    py, ipynb = notebook_pair
    newer(ipynb)  # as after `python tools/build.py`: jupytext refuses a newer .ipynb whose inputs differ from the .py
    manager = TextFileContentsManager(root_dir=str(py.parent))
    model = manager.get(ipynb.name)
    cells = model["content"]["cells"]
    index = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
    cells[index]["source"] += '\nprint("saved from Jupyter")'
    manager.save(model, ipynb.name)
    assert 'print("saved from Jupyter")' in py.read_text(encoding="utf-8")
    assert manager.get(py.name)["type"] == "notebook"  # the .py opens as a notebook too


def test_repo_notebooks_paired():
    import nbformat

    config = (REPO / "notebooks" / "jupytext.toml").read_text(encoding="utf-8")
    assert f'formats = "{PAIRED}"' in config
    for ipynb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert nbformat.read(ipynb, as_version=4).metadata.get("jupytext") == {"formats": PAIRED}, ipynb.name


METHODS = '''
    # %%
    from minirl.runtime.notebook import add_to_class

    # %%
    # | export minirl/shapes.py
    """Shapes, built up across cells."""


    class Square:
        """A square of side `side`."""

        def __init__(self, side):
            self.side = side

    # %% [markdown]
    # Its area, in a cell of its own:

    # %%
    # | export minirl/shapes.py
    import math


    # the area, a plain method
    @add_to_class(Square)
    def area(self):
        """side squared."""
        return self.side ** 2


    @add_to_class(Square)
    @property
    def diagonal(self):
        """The diagonal,
        a docstring over two lines (moved as it is)."""
        return (f"{self.side}" f"{math.sqrt(2)}"
                f"{self.side * math.sqrt(2)}") and self.side * math.sqrt(2)   # an f-string over two lines moves


    def unit():
        return Square(1)
'''


def test_add_to_class_moves_methods_into_the_class(tmp_path):
    """The generated module reads as if written in one piece: the methods inside the class, no decorator,
    the comment above a method kept with it, the other code of the cell where it was."""
    root = make_tree(tmp_path, {"00_shapes.py": METHODS})
    build(root, check=False)
    text = read(root, "minirl/shapes.py")
    assert "add_to_class" not in text
    tree = ast.parse(text)
    square = next(n for n in tree.body if getattr(n, "name", None) == "Square")
    assert [n.name for n in square.body if hasattr(n, "name")] == ["__init__", "area", "diagonal"]
    assert [n.name for n in tree.body if hasattr(n, "name")] == ["Square", "unit"], "no method at module level"
    assert '__all__ = ["Square", "unit"]' in text
    assert "        self.side = side\n\n    # the area, a plain method\n    def area(self):" in text
    assert "        return self.side ** 2\n\n    @property\n    def diagonal(self):" in text
    with another_minirl(root):
        from minirl.shapes import Square, unit
        assert (Square(3).area(), round(unit().diagonal, 6)) == (9, round(2 ** 0.5, 6))


def test_add_to_class_moves_a_message_wrapped_over_lines(tmp_path):
    """Pieces of a string implicitly joined over several lines are each on one line: indenting them changes
    no text, so such a method moves (a multi-line string literal does not, in the test below)."""
    source = ('# %%\n# | export minirl/shapes.py\n"""Shapes."""\n\n\nclass Square:\n    side = 1\n\n'
              '# %%\n# | export minirl/shapes.py\n@add_to_class(Square)\ndef check(self):\n'
              '    """Multi-line docstrings\n    move too."""\n'
              '    raise ValueError(f"side={self.side}: "\n                     "must be positive")\n')
    root = make_tree(tmp_path, {"00_shapes.py": source})
    build(root, check=False)
    assert ('    def check(self):\n        """Multi-line docstrings\n        move too."""\n'
            '        raise ValueError(f"side={self.side}: "\n                         "must be positive")\n'
            ) in read(root, "minirl/shapes.py")


@pytest.mark.parametrize(("method", "message"), [
    ("@add_to_class(Circle)\ndef area(self):\n    return 0\n", "defines class Circle"),
    ("@add_to_class(Square)\ndef area(self):\n    return super().area()\n", "super()"),
    ("@add_to_class(Square)\ndef area(self):\n    return self.__side\n", "__side"),
    ("@add_to_class(Square)\ndef area(self):\n    return '''a\nb'''\n", "multi-line string"),
    ("@add_to_class(Square)\ndef area(self):\n    return (f'''{self}\nb''')\n", "multi-line string"),
    ("@add_to_class(Square)\ndef area(self):\n    return f'a{1}\\\nb'\n", "multi-line string"),
    ("@add_to_class(Square)\ndef area(self):\n    return " + "1 + " * 27 + "1\n", "once indented"),
    ("from minirl.runtime.notebook import add_to_class\n", "without the export marker"),
    ("@add_to_class(Square)\ndef area(self):\n    # BEGIN SOLUTION\n    return 0\n    # END SOLUTION\n",
     "exercise"),
])
def test_add_to_class_refuses_a_move_that_would_change_the_code(tmp_path, method, message):
    source = ('# %%\n# | export minirl/shapes.py\n"""Shapes."""\n\n\nclass Square:\n    side = 1\n\n'
              f"# %%\n# | export minirl/shapes.py\n{method}")
    root = make_tree(tmp_path, {"00_shapes.py": source})
    with pytest.raises(BuildError, match=re.escape(message)):
        build(root, check=False)
