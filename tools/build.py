"""Build the minirl package, the exercises and the .ipynb files from the notebooks.

The jupytext "percent" files notebooks/NN_slug.py are the single source of truth:

    notebooks/NN_slug.py --+--> minirl/<module>.py       its export cells, gathered per module
                           +--> exercises/NN_slug.py     the same cells, solutions cut out
                           +--> notebooks/NN_slug.ipynb  for Jupyter, without outputs, paired with
                                                         the .py by jupytext (saving either updates both)

An export cell is a code cell whose first non-blank line is `# | export minirl/tasks.py`.
Notebooks are read in filename order and cells in notebook order, so a module may gather
cells from several notebooks. In a module the cells' top-level imports are hoisted (and
sorted as ruff's isort rule sorts them), the
first cell's docstring becomes the module docstring, `__all__` lists the public names
(top-level defs, classes and UPPER_CASE constants, in order of definition), runs of blank
lines are collapsed (two at most between top-level blocks, one inside), and the
`# BEGIN SOLUTION` / `# END SOLUTION` marker lines are dropped.

An exercise file holds only the notebook's export cells that contain a solution span, each
span cut to a `raise NotImplementedError(...)` stub. It imports what those cells need: their
own imports, and the names they use that other cells define or import (from the minirl
module those cells export to). It never imports from minirl an exercise's answer (of any
notebook) or a name the file itself defines, so a student cannot call the solution by
accident; the rest of the package stays importable as usual.

A function-level `import minirl...` / `from minirl... import` in an export cell gets a
build warning unless a comment on its line says why it is not at the top of the module.

Reading cells and rendering a module's text live in tools/notebook_cells.py.

    python tools/build.py           write what changed, delete stale generated files
    python tools/build.py --check   write nothing; exit 1 if anything is out of date
"""

from __future__ import annotations

import argparse
import ast
import builtins
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import jupytext
import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))   # tools/notebook_cells.py, however build.py is loaded
from notebook_cells import (  # noqa: E402
    BuildError,
    BuildWarning,
    Cell,
    Import,
    assemble,
    body,
    bound_name,
    enclosing_function,
    export_cells,
    header,
    import_groups,
    is_minirl_import,
    module_name,
    one_name,
    render_module,
)

ROOT = Path(__file__).resolve().parent.parent

# Modules under minirl/ that no notebook generates (any __init__.py is allowed as well). The plumbing no lesson
# teaches lives in one folder, minirl/runtime/; four hand-written modules stay beside the concept they serve: the
# grader (its command is `python -m minirl.grade`), the reward registry (a seam, `minirl.tasks.rewards`) and the
# data-set generators (`python -m minirl.tasks.word_problems`, `... arithmetic_chat`: data, not plumbing).
HAND_WRITTEN = ("minirl/__init__.py", "minirl/grade.py", "minirl/grade_child.py", "minirl/tasks/rewards.py",
                "minirl/tasks/word_problems.py",
                "minirl/tasks/arithmetic_chat.py",
                "minirl/runtime/__init__.py", "minirl/runtime/argtypes.py", "minirl/runtime/cli.py",
                "minirl/runtime/data_files.py", "minirl/runtime/io.py", "minirl/runtime/latex_math.py",
                "minirl/runtime/launch.py", "minirl/runtime/notebook.py", "minirl/runtime/progress.py",
                "minirl/runtime/rundir.py", "minirl/runtime/seeding.py", "minirl/runtime/smollm2.py",
                "minirl/runtime/timing.py",
                "minirl/runtime/training_cli.py", "minirl/runtime/validate.py",
                "minirl/runtime/trl_config.py", "minirl/runtime/schedule.py", "minirl/runtime/trackers.py",
                # notebook 09
                "minirl/runtime/diagnosis_report.py", "minirl/runtime/mfu_inputs.py",
                "minirl/runtime/profile_tables.py", "minirl/runtime/profiling_plots.py",
                "minirl/runtime/ray_timeline.py", "minirl/runtime/run_records.py", "minirl/runtime/stage_runs.py",
                # notebook 08 (issue 29): its plumbing, harnesses and plot styling
                "minirl/runtime/balancing_hooks.py", "minirl/runtime/dualpipev.py",
                "minirl/runtime/expert_job.py", "minirl/runtime/moe_cache.py", "minirl/runtime/moe_checks.py",
                "minirl/runtime/moe_plots.py", "minirl/runtime/packing_bench.py", "minirl/runtime/pipeline_job.py",
                "minirl/runtime/pipeline_sim.py", "minirl/runtime/pipeline_types.py",
                "minirl/runtime/routing_bench.py",
                # notebook 05 (generation speed):
                "minirl/runtime/cache_upkeep.py", "minirl/runtime/drafts.py", "minirl/runtime/engine_core.py",
                "minirl/runtime/engine_measure.py", "minirl/runtime/generation_display.py",
                "minirl/runtime/paged_ops.py", "minirl/runtime/paged_kernels.py",
                "minirl/runtime/scheduler_state.py", "minirl/runtime/workloads.py",
                # notebook 07's plumbing
                "minirl/runtime/async_bookkeeping.py", "minirl/runtime/async_config.py",
                "minirl/runtime/async_envs.py", "minirl/runtime/async_plots.py", "minirl/runtime/async_ray.py",
                "minirl/runtime/async_run.py", "minirl/runtime/async_snapshots.py",
                # notebook 04's plumbing
                "minirl/runtime/buckets.py", "minirl/runtime/lockstep.py", "minirl/runtime/memory_tracking.py",
                "minirl/runtime/parallel_checks.py", "minirl/runtime/policy_export.py",
                "minirl/runtime/prompt_seeds.py", "minirl/runtime/push_checks.py", "minirl/runtime/ranks.py",
                "minirl/runtime/sharded_checkpoint.py", "minirl/runtime/stops.py", "minirl/runtime/sync_meter.py",
                "minirl/runtime/spmd_support.py", "minirl/runtime/vllm_check.py", "minirl/runtime/vllm_setup.py",
                # notebook 01: its plumbing, and the seams it uses but no longer builds (read beside their concept)
                "minirl/runtime/callbacks.py", "minirl/runtime/checkpoint.py", "minirl/runtime/inputs.py",
                "minirl/runtime/plots.py", "minirl/runtime/prefix_sharing.py",
                "minirl/config.py", "minirl/data.py", "minirl/rollout/base.py", "minirl/rollout/hf.py",
                "minirl/rollout/sampling.py", "minirl/rollout/shared_prefix.py", "minirl/runtime/gauges.py",
                "minirl/sync/base.py", "minirl/runtime/loss_weights.py",
                "minirl/models/critic.py", "minirl/roles/reference.py",
                # notebook 06's plumbing (Ray start-up, waits and deaths, checks, the run around the Driver, plots)
                "minirl/runtime/ray_start.py", "minirl/runtime/ray_calls.py", "minirl/runtime/placement_checks.py",
                "minirl/runtime/driver_run.py", "minirl/runtime/role_checkpoints.py", "minirl/runtime/cluster_plots.py",
                "minirl/runtime/source_rows.py", "minirl/runtime/object_store_sync.py",
                # notebook 00: the policy cache, model loading, the math verifier, task files; tasks/task.py beside
                # its concept
                "minirl/runtime/completions.py", "minirl/runtime/config_checks.py", "minirl/runtime/math_answer.py",
                "minirl/runtime/model_loading.py", "minirl/runtime/policy_cache.py",
                "minirl/runtime/task_files.py", "minirl/tasks/task.py",
                # notebook 03
                "minirl/memory/measure.py", "minirl/memory/wrap.py", "minirl/runtime/memory_checks.py",
                "minirl/runtime/memory_plots.py", "minirl/runtime/zero_measure.py",
                # notebook 02
                "minirl/runtime/logprob_checks.py", "minirl/runtime/logprob_measure.py",
                "minirl/runtime/mismatch_report.py", "minirl/runtime/mismatch_runs.py",
                # notebook 01, second cut: the argument checks of its functions
                "minirl/runtime/arg_checks.py", "minirl/roles/critic.py",
                "minirl/train/run.py",
                # notebook 02 (second cut): routing tools around R3, the synchronization check
                "minirl/runtime/moe_routes.py", "minirl/runtime/sync_checks.py",
                # notebook 06, second cut: Ray reservations, a worker's ends of the syncs
                "minirl/runtime/reservations.py", "minirl/runtime/sync_ends.py",
                "minirl/runtime/accelerate_launch.py",  # branch peft: accelerate launch for chapters 01 and 04
                "minirl/runtime/run_answers.py",  # branch nb01real: notebook 01 §11, a real model's answers
                "minirl/runtime/reward_extras.py",  # branch rewards: TRL's extras to reward functions
                "minirl/runtime/completion_log.py",   # branch trlux: issue 31 item 3, what the model wrote
                )

MODULE_PREFIX = "# Generated from notebooks/"
EXERCISE_PREFIX = "# Exercises of notebooks/"
OUT_OF_SYNC = "notebooks and package out of sync: run python tools/build.py"
STALE = "stale (no notebook generates it any more)"
UNLISTED = "unlisted hand-written module (add it to HAND_WRITTEN in tools/build.py)"
ORPHAN = "no notebooks/*.py source (pair it with jupytext or delete it)"

KERNEL = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}
# jupytext's pairing, as it writes it in an .ipynb (the .py's header holds the same formats, and
# notebooks/jupytext.toml pairs the folder): Jupyter saves the .py whenever it saves the .ipynb.
PAIRING = {"jupytext": {"formats": "ipynb,py:percent"}}


@dataclass
class Project:
    """Every notebook's export cells, by notebook and by module, and what an exercise file needs."""

    by_notebook: dict[str, list[Cell]]  # notebook -> its export cells, in order
    modules: dict[str, list[Cell]]  # module path -> its cells, notebook order; cells[0] holds the docstring
    answers: dict[str, str]  # name of a def/class holding a solution span -> "N.M" of its first exercise
    titles: dict[str, str | None]  # notebook -> its first markdown heading


def exercise_imports(notebook: str, included: list[Cell], project: Project) -> list[Import]:
    """The imports of the exercise file made of `included` (see the module docstring for the rule)."""
    defined = {name for cell in included for name in cell.defines()}
    forbidden = defined | set(project.answers)
    imports = []
    for cell in included:
        for node in cell.imports():
            if not is_minirl_import(node):
                imports.append((node, cell.segment(node)))
                continue
            keep = [alias for alias in node.names if bound_name(alias, node) not in forbidden]
            if len(keep) == len(node.names):
                imports.append((node, cell.segment(node)))
            elif keep:
                cut = ast.ImportFrom(module=node.module, names=keep, level=node.level) \
                    if isinstance(node, ast.ImportFrom) else ast.Import(names=keep)
                imports.append((cut, ast.unparse(cut)))
    bound = defined | {bound_name(alias, node) for node, _ in imports for alias in node.names}
    uses = [(cell, cell.uses()) for cell in included]
    needed = set().union(*(names for _, names in uses)) - bound - set(dir(builtins))
    # where to look: this notebook's cells, then the other cells of the modules these cells export to
    targets = {cell.target for cell in included}
    nearby = [c for c in project.by_notebook[notebook] if c not in included]
    nearby += [c for cells in project.by_notebook.values() for c in cells
               if c.target in targets and c.notebook != notebook]
    everywhere = [c for cells in project.by_notebook.values() for c in cells]
    for name in sorted(needed):
        user = next(cell for cell, names in uses if name in names)
        found = resolve(name, nearby) or resolve(name, everywhere)
        if found is None:
            warnings.warn(BuildWarning(
                f"{user.where(0)}: exercises/{PurePosixPath(notebook).name} uses `{name}`, which no export cell "
                "defines or imports: define it in an export cell (the package module lacks it too)"), stacklevel=2)
            continue
        node, cell = found
        if name in project.answers and is_minirl_import(node):
            raise BuildError(
                f"{user.where(0)}: this cell holds an exercise and uses `{name}`, the answer to exercise "
                f"{project.answers[name]} ({cell.where(0)}); its stub file may not import it: move the code "
                "that needs it to a cell without solution spans, or make the exercise not depend on it")
        imports.append((node, ast.unparse(node)))
    return imports


def resolve(name: str, cells: list[Cell]) -> tuple[ast.Import | ast.ImportFrom, Cell] | None:
    """An import statement that binds `name` as `cells` do: importing their definition, or their import."""
    for cell in cells:
        if name in cell.defines():
            return ast.ImportFrom(module=module_name(cell.target), names=[ast.alias(name)], level=0), cell
        for node in cell.imports():
            for alias in node.names:
                if bound_name(alias, node) == name:
                    return one_name(node, alias), cell
    return None


def notebook_title(text: str) -> str | None:
    """The first markdown heading of a notebook, without its leading number: "The task, the policy"."""
    if m := re.search(r"^# #+ (?:\d\d\s*[·:.-]\s*)?(.+?)\s*$", text, re.M):
        return m[1]
    return None


def render_exercises(notebook: str, project: Project, solutions: bool = False) -> str:
    """The notebook's export cells that hold exercises, every solution span replaced by a stub."""
    nn = PurePosixPath(notebook).name[:2]
    included = [cell for cell in project.by_notebook[notebook] if cell.spans]
    title = project.titles.get(notebook)
    if title is None:
        first = project.by_notebook[notebook][0]
        docstring = first.docstring() or project.modules[first.target][0].docstring()
        title = next(iter(docstring.value.value.strip().splitlines()), "")
    summary = title if title.endswith((".", "!", "?")) else title + "."
    head = (
        f"{EXERCISE_PREFIX}{PurePosixPath(notebook).name}, generated by tools/build.py"
        " -- fill in the stubs, then grade:\n"
        f"#     python -m minirl.grade --only {nn}\n"
        f'"""Exercises for notebook {nn}: {summary}\n\n'
        "Each `raise NotImplementedError` marks code to write; the docstring above it says what to return.\n"
        "Only the notebook's cells that hold exercises are here; the rest of its code is in minirl,\n"
        "imported below where these cells use it.\n"
        '"""'
    )
    bodies, count = [], 0
    for cell in included:
        stubs = []
        for begin, _ in cell.spans:
            count += 1
            name = enclosing_function(cell.tree, begin + 1)
            what = f"exercise {int(nn)}.{count}: {name} -- see its docstring and notebook {nn}"
            stubs.append(f'raise NotImplementedError("{what}")')
        opens_module = project.modules[cell.target][0] is cell
        bodies.append(body(cell, drop_docstring=opens_module, stubs=None if solutions else stubs))
    imports = import_groups(exercise_imports(notebook, included, project))
    return assemble(head, imports, bodies, f"exercises/{PurePosixPath(notebook).name}")


def render_ipynb(text: str) -> str:
    """The notebook as .ipynb paired with its .py: no outputs, fixed metadata and cell ids (reproducible bytes).

    The cells keep jupytext's `lines_to_next_cell` (the blank lines after a cell in the .py, where
    they differ from its default): with them the pair's inputs are identical, so jupytext opens
    the pair whichever file is newer, and saving the .ipynb rewrites the .py's cells as they were.
    """
    nb = jupytext.reads(text, fmt="py:percent")
    nb.metadata = nbformat.from_dict({**PAIRING, **KERNEL})
    nb.nbformat, nb.nbformat_minor = 4, 5
    for i, cell in enumerate(nb.cells):
        cell.id = f"c{i:03d}"
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nbformat.writes(nb, version=4) + "\n"


# ---------------------------------------------------------------- the build


def is_generated(path: Path) -> bool:
    with path.open(encoding="utf-8", errors="replace") as f:
        return f.readline().startswith((MODULE_PREFIX, EXERCISE_PREFIX))


def package_markers(root: Path, modules: dict[str, list[Cell]]) -> dict[str, str]:
    """A generated __init__.py for each subpackage of minirl/ that exports land in, unless one is hand-written."""
    sources: dict[str, list[str]] = {}
    for target, cells in modules.items():
        parts = PurePosixPath(target).parent.parts
        for k in range(2, len(parts) + 1):
            sources.setdefault("/".join(parts[:k]), []).extend(c.notebook for c in cells)
    markers = {}
    for package, notebooks in sorted(sources.items()):
        init = f"{package}/__init__.py"
        path = root / init
        if init in modules or init in HAND_WRITTEN or path.exists() and not is_generated(path):
            continue
        markers[init] = f'{header(notebooks)}\n"""{package.replace("/", ".")}."""\n'
    return markers


def read_notebooks(root: Path) -> tuple[dict[str, str], Project]:
    """The notebooks' texts {notebook: text} and their parsed export cells. Raises BuildError."""
    texts, by_notebook = {}, {}
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.py")):
        notebook = path.relative_to(root).as_posix()
        texts[notebook] = path.read_text(encoding="utf-8")
        by_notebook[notebook] = export_cells(notebook, texts[notebook])
    modules: dict[str, list[Cell]] = {}
    for cells in by_notebook.values():
        for cell in cells:
            modules.setdefault(cell.target, []).append(cell)
    answers = {}  # the exercise numbering of render_exercises: N.1, N.2, ... over the notebook's spans
    for notebook, cells in by_notebook.items():
        names = [name for cell in cells for name in cell.answers()]
        for k, name in enumerate(names, 1):
            if name is not None:
                answers.setdefault(name, f"{int(PurePosixPath(notebook).name[:2])}.{k}")
    titles = {notebook: notebook_title(text) for notebook, text in texts.items()}
    return texts, Project(by_notebook, modules, answers, titles)


def exercise_files(project: Project, solutions: bool = False) -> dict[str, str]:
    """{"exercises/NN_slug.py": text} for each notebook with solution spans; `solutions` keeps
    them in place of the stubs (what tests use to check that an exercise file's imports suffice)."""
    return {f"exercises/{PurePosixPath(notebook).name}": render_exercises(notebook, project, solutions)
            for notebook, cells in project.by_notebook.items() if any(cell.spans for cell in cells)}


def generate(root: Path) -> dict[str, str]:
    """Every generated file, as {path relative to root: content}. Reads only; raises BuildError."""
    texts, project = read_notebooks(root)
    files = {notebook.removesuffix(".py") + ".ipynb": render_ipynb(text) for notebook, text in texts.items()}
    for target, cells in project.modules.items():
        path = root / target
        if target in HAND_WRITTEN or path.exists() and not is_generated(path):
            raise BuildError(f"{cells[0].where(0)}: exports to {target}, a hand-written module; pick another name")
        files[target] = render_module(target, cells)
    files.update(exercise_files(project))
    files.update(package_markers(root, project.modules))
    return sort_imports(root, files)


def sort_imports(root: Path, files: dict[str, str]) -> dict[str, str]:
    """`files` with the imports of every .py in the order the project's lint wants (ruff's isort rule, `I`).

    The cells' imports are merged above (`import_groups`); ruff then orders them as it orders a
    hand-written module, with the settings of `root`'s pyproject.toml (this project's if it has
    none), so a generated module passes the same lint. Runs ruff once, on temporary copies.
    """
    sources = {rel: text for rel, text in files.items() if rel.endswith(".py")}
    with tempfile.TemporaryDirectory() as tmp:
        own = root / "pyproject.toml"
        settings = own if own.exists() else ROOT / "pyproject.toml"
        shutil.copy(settings, Path(tmp) / "pyproject.toml")
        for rel, text in sources.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_text(text, encoding="utf-8")
        command = [sys.executable, "-m", "ruff", "check", "--select", "I", "--fix", "--exit-zero", "--quiet",
                   "--no-cache", "."]
        done = subprocess.run(command, cwd=tmp, capture_output=True, text=True)
        if done.returncode:
            raise BuildError(f"ruff could not sort the generated imports: {done.stderr.strip() or done.stdout.strip()}")
        return {**files, **{rel: (Path(tmp) / rel).read_text(encoding="utf-8") for rel in sources}}


def leftovers(root: Path, files: dict[str, str]) -> list[tuple[str, str]]:
    """Files in the generated folders that no notebook produces, with the reason they are a problem."""
    found = [*(root / "minirl").rglob("*.py"), *(root / "exercises").rglob("*.py")]
    found += (root / "notebooks").glob("[0-9][0-9]_*.ipynb")
    problems = []
    for path in sorted(found):
        rel = path.relative_to(root).as_posix()
        if rel in files or any(part.startswith(".") for part in PurePosixPath(rel).parts):
            continue
        if path.suffix == ".ipynb":
            problems.append((rel, ORPHAN))
        elif is_generated(path):
            problems.append((rel, STALE))
        elif rel.startswith("minirl/") and rel not in HAND_WRITTEN and path.name != "__init__.py":
            problems.append((rel, UNLISTED))
    return problems


def sync(root: Path, files: dict[str, str], check: bool) -> list[str]:
    """Compare `files` with the tree; unless `check`, write changes and delete stale files."""
    report = []
    for rel, text in sorted(files.items()):
        path = root / rel
        old = path.read_bytes() if path.exists() else None
        if old == text.encode("utf-8"):
            continue
        if check:
            report.append(f"{rel}: {'missing' if old is None else 'differs'}")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))
            report.append(f"{rel}: written")
    for rel, reason in leftovers(root, files):
        if reason == STALE and not check:
            (root / rel).unlink()
            reason = "deleted (stale)"
        report.append(f"{rel}: {reason}")
    return report


def build(root: Path, check: bool) -> list[str]:
    """Regenerate everything under `root`; returns "path: what" lines (problems if `check`, else changes)."""
    return sync(Path(root), generate(Path(root)), check)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything is out of date")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BuildWarning)
            files = generate(args.root)
        report = sync(args.root, files, args.check)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for w in caught:
            if issubclass(w.category, BuildWarning):
                print(f"warning: {w.message}", file=sys.stderr)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    for line in report:
        print(f"  {line}")
    if args.check:
        print(OUT_OF_SYNC if report else f"in sync ({len(files)} files)")
        return 1 if report else 0
    if any(line.endswith((UNLISTED, ORPHAN)) for line in report):
        print("built, but the files above need a hand: see their messages")
        return 1
    print(f"built {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
