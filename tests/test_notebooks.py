"""Every notebook runs top to bottom, headless, in smoke mode (MINIRL_SMOKE=1)."""

import os
import time
from pathlib import Path

import jupytext
import nbclient
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_smoke_mode(path, monkeypatch, tmp_path):
    monkeypatch.setenv("MINIRL_SMOKE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # the kernel imports this checkout's minirl, whichever copy is installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    notebook = jupytext.read(path)
    started = time.perf_counter()
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()
    elapsed = time.perf_counter() - started
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.output_type == "error"]
    assert not errors, errors
    print(f"{path.name}: {elapsed:.0f} s in smoke mode")
