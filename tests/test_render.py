"""Tests of tools/render.py (rendered copies, stamps, --check) and of the static site in headless Chromium.

The execute path runs tiny synthetic notebooks in a temporary repository layout (one draws a
figure); the real notebooks are never executed here. The browser tests load every page of a
site built from the repository's committed copies, and of one built from the synthetic render.
"""

import functools
import hashlib
import http.server
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("minirl_tools_render", REPO / "tools" / "render.py")
render_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_tool)

README = """\
    # t

    ## The learning path

    | notebook | what you learn | status |
    |---|---|---|
    | [90 plot](notebooks/90_plot.py) | a figure | ready |
    | [91 text](notebooks/91_text.py) | an environment variable | ready |

    ## Next
    """
PLOT = '''\
    # %% [markdown]
    # # 90 · A figure

    # %%
    import matplotlib.pyplot as plt
    from tqdm.auto import tqdm

    for _ in tqdm(range(3), desc="steps"):
        pass
    print("hello from 90")

    # %%
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [1, 0])
    plt.show()
    '''
TEXT = '''\
    # %% [markdown]
    # # 91 · Text

    # %%
    import os

    print("smoke:", os.environ.get("MINIRL_SMOKE"))
    '''


def make_tree(root: Path, notebooks: dict[str, str], crlf: tuple[str, ...] = ()) -> Path:
    """A repository layout: README with a learning path, mkdocs.yml (the real one), notebooks/<name>.py."""
    (root / "notebooks").mkdir(parents=True)
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(REPO / "docs" / "stylesheets", root / "docs" / "stylesheets")
    (root / "README.md").write_text(textwrap.dedent(README))
    for name, source in notebooks.items():
        text = textwrap.dedent(source)
        if name in crlf:  # Windows line endings: a stamp of the decoded text would differ from one of the bytes
            text = text.replace("\n", "\r\n")
        (root / "notebooks" / name).write_bytes(text.encode())
    return root


def run_render(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "render.py"), "--root", str(root), *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=900)


def main(capsys, root: Path, *args: str) -> subprocess.CompletedProcess:
    """tools/render.py's command line in this process (for what executes nothing): exit code, stdout, stderr."""
    code = render_tool.main(["--root", str(root), *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def fake_copy(root: Path, stem: str, digest: str, mode: str = "full") -> None:
    """A rendered copy as render.py writes one, without executing anything."""
    (root / "docs" / "notebooks").mkdir(parents=True, exist_ok=True)
    nb = {"cells": [], "metadata": {"minirl": {"source": f"notebooks/{stem}.py", "sha256": digest, "mode": mode}},
          "nbformat": 4, "nbformat_minor": 5}
    (root / "docs" / "notebooks" / f"{stem}.ipynb").write_text(json.dumps(nb))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """A synthetic repository rendered in full mode (site included), with MINIRL_SMOKE=1 in the caller's environment."""
    root = make_tree(tmp_path_factory.mktemp("render"), {"90_plot.py": PLOT, "91_text.py": TEXT}, crlf=("91_text.py",))
    done = run_render(root, env={"MINIRL_SMOKE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return root, done.stdout


# ---------------------------------------------------------------- stamps and --check (nothing executed)


def test_check_names_a_copy_whose_source_changed(tmp_path, capsys):
    root = make_tree(tmp_path, {"90_plot.py": PLOT, "91_text.py": TEXT})
    stamps = {}
    for stem in ("90_plot", "91_text"):
        digest = hashlib.sha256((root / "notebooks" / f"{stem}.py").read_bytes()).hexdigest()
        fake_copy(root, stem, digest)
        stamps[f"notebooks/{stem}.py"] = digest
    (root / "docs" / "stamps.json").write_text(json.dumps(stamps))
    (root / "docs" / "index.md").write_text(render_tool.index_page(root, stamps))
    assert render_tool.check(root) == ([], [])
    done = main(capsys, root, "--check")
    assert done.returncode == 0
    assert done.stdout.splitlines()[-1] == "render check: all 2 rendered copies match their sources"

    with (root / "notebooks" / "91_text.py").open("ab") as f:
        f.write(b"\n")  # one byte: the text reads the same, the stamp does not
    lines, refresh = render_tool.check(root)
    assert refresh == ["91"]
    assert len(lines) == 1 and lines[0].startswith("docs/notebooks/91_text.ipynb: stale: notebooks/91_text.py changed")
    assert lines[0].endswith("refresh: python tools/render.py --only 91")
    done = main(capsys, root, "--check")
    assert done.returncode == 0, "--check lists, it does not fail (CI shows the list)"
    assert lines[0] in done.stdout
    assert done.stdout.splitlines()[-1] == ("render check: 1 of 2 rendered copies current, 1 to refresh: "
                                            "python tools/render.py --only 91")
    assert main(capsys, root, "--check", "--strict").returncode == 1


def test_check_lists_missing_unstamped_smoke_and_orphaned_copies(tmp_path):
    root = make_tree(tmp_path, {"90_plot.py": PLOT, "91_text.py": TEXT, "92_more.py": TEXT})
    digest = hashlib.sha256((root / "notebooks" / "91_text.py").read_bytes()).hexdigest()
    fake_copy(root, "91_text", digest, mode="smoke")   # stamped, but a smoke copy
    fake_copy(root, "92_more", digest)                  # a copy with no entry in stamps.json
    fake_copy(root, "80_gone", digest)                  # its source was deleted
    stamps = {"notebooks/91_text.py": digest, "notebooks/80_gone.py": digest}
    (root / "docs" / "stamps.json").write_text(json.dumps(stamps))
    lines, refresh = render_tool.check(root)
    assert refresh == ["90", "91", "92"]
    text = "\n".join(lines)
    assert "docs/notebooks/90_plot.ipynb: missing (never rendered)" in text
    assert "docs/notebooks/91_text.ipynb: its own stamp disagrees with docs/stamps.json (or it is not a full render)" \
        in text
    assert "docs/notebooks/92_more.ipynb: not in docs/stamps.json" in text
    assert "docs/stamps.json: stamps notebooks/80_gone.py, which no longer exists" in text
    assert "docs/notebooks/80_gone.ipynb: no notebooks/80_gone.py any more; delete it" in text
    assert "docs/index.md: out of date; refresh: python tools/render.py --site" in text


def test_bad_flags_are_one_line_errors_before_any_work(tmp_path, capsys):
    root = make_tree(tmp_path, {"90_plot.py": PLOT})
    done = main(capsys, root, "--only", "42")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --only '42': no notebook numbered 42; choose from 90"
    assert not (root / "docs" / "notebooks").exists() and not (root / "docs" / "stamps.json").exists()
    (root / "docs" / "stamps.json").write_text("{not json")
    done = main(capsys, root, "--check")
    assert done.returncode == 2 and done.stderr.startswith("error: docs/stamps.json: not JSON")


# ---------------------------------------------------------------- executing (tiny synthetic notebooks)


def test_render_executes_in_full_mode_and_stamps_the_source_bytes(rendered):
    root, output = rendered
    stamps = json.loads((root / "docs" / "stamps.json").read_text())
    assert stamps == {f"notebooks/{n}.py": hashlib.sha256((root / "notebooks" / f"{n}.py").read_bytes()).hexdigest()
                      for n in ("90_plot", "91_text")}
    assert "  [90] cell 2/2" in output and "rendered 2 of 2 notebooks" in output  # a progress line per cell
    text = json.loads((root / "docs" / "notebooks" / "91_text.ipynb").read_text())
    printed = "".join(o["text"] if isinstance(o["text"], str) else "".join(o["text"])
                      for c in text["cells"] for o in c.get("outputs", []) if o["output_type"] == "stream")
    assert printed == "smoke: None\n", "full mode: MINIRL_SMOKE is unset in the kernel, whatever the caller had"
    assert render_tool.check(root) == ([], [])


def test_copy_has_its_figure_and_reproducible_metadata(rendered):
    root, _ = rendered
    nb = json.loads((root / "docs" / "notebooks" / "90_plot.ipynb").read_text())
    assert nb["metadata"] == {**render_tool.KERNEL, "minirl": {
        "source": "notebooks/90_plot.py", "mode": "full",
        "sha256": hashlib.sha256((root / "notebooks" / "90_plot.py").read_bytes()).hexdigest()}}
    assert [c["id"] for c in nb["cells"]] == ["c000", "c001", "c002"]
    assert all(set(c["metadata"]) <= {"tags"} for c in nb["cells"])  # no timing, no jupytext hints
    outputs = [o for c in nb["cells"] for o in c.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1
    streams = {o["name"]: "".join(o["text"]) for o in outputs if o["output_type"] == "stream"}
    assert streams["stdout"] == "hello from 90\n"
    assert streams["stderr"].startswith("steps: 100%") and "\r" not in streams["stderr"]  # tqdm's text bar, last state
    assert not any("widget" in key for o in outputs for key in o.get("data", {}))


def test_smoke_render_never_touches_the_stamped_copies(rendered, tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(rendered[0], root)
    before = {p: p.read_bytes() for p in (root / "docs").rglob("*") if p.is_file()}
    with (root / "notebooks" / "91_text.py").open("ab") as f:
        f.write(b"# edited since the full render\r\n")  # a smoke run must not make the old copy look current
    done = run_render(root, "--smoke", "--only", "91")
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p: p.read_bytes() for p in (root / "docs").rglob("*") if p.is_file()} == before
    assert render_tool.check(root)[1] == ["91"]
    smoke = json.loads((root / "build" / "render-smoke" / "91_text.ipynb").read_text())
    assert smoke["metadata"]["minirl"]["mode"] == "smoke"
    assert "smoke: 1" in "".join(smoke["cells"][1]["outputs"][0]["text"])


def test_failing_notebook_keeps_its_old_copy_and_stamp(rendered, tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(rendered[0], root)
    copy, stamps = root / "docs" / "notebooks" / "91_text.ipynb", root / "docs" / "stamps.json"
    old_copy, old_stamps = copy.read_bytes(), stamps.read_bytes()
    with (root / "notebooks" / "91_text.py").open("a") as f:
        f.write("\r\n# %%\r\nraise ValueError(\"boom in 91\")\r\n")
    done = run_render(root, "--only", "91,90", "--no-site")
    assert done.returncode == 1
    line = "FAILED notebooks/91_text.py cell 2/2 (line 10): ValueError: boom in 91"
    assert line in done.stdout and done.stdout.rstrip().endswith(line)
    assert "the previous copy and stamp are kept" in done.stdout
    assert copy.read_bytes() == old_copy and json.loads(stamps.read_bytes())["notebooks/91_text.py"] == \
        json.loads(old_stamps)["notebooks/91_text.py"]
    assert "rendered 1 of 2 notebooks" in done.stdout  # 90 still rendered after 91 failed
    assert render_tool.check(root)[1] == ["91"]


def test_index_lists_the_learning_path_with_stamps(rendered):
    root, _ = rendered
    index = (root / "docs" / "index.md").read_text()
    stamps = json.loads((root / "docs" / "stamps.json").read_text())
    assert "| [90 plot](notebooks/90_plot.ipynb) | a figure | ready | `" + stamps["notebooks/90_plot.py"][:12] + "` |" \
        in index
    assert "| notebook | what you learn | status | rendered from (sha256) |" in index


# ---------------------------------------------------------------- the site in headless Chromium

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGE_STATE = """
const nav = performance.getEntriesByType('navigation')[0];
return {
  state: document.readyState,
  status: nav ? nav.responseStatus : null,
  cells: document.querySelectorAll('.jp-Cell').length,
  failed: performance.getEntriesByType('resource')
    .filter(e => e.name.startsWith(location.origin) && e.responseStatus >= 400)
    .filter(e => !e.name.endsWith('/favicon.ico'))  // the browser's own request where a page names no icon
    .map(e => e.name),
  images: Array.from(document.images).map(i => ({src: i.currentSrc.slice(0, 60), complete: i.complete,
                                                 width: i.naturalWidth})),
};
"""


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by selenium with the apt chromedriver (Selenium Manager never downloads one)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if not (chromium and driver and webdriver):
        missing = "selenium (pip install -r requirements.txt)" if webdriver is None else \
            "chromium and chromedriver (apt-get install -y chromium chromium-driver)"
        if os.environ.get("MINIRL_CI") == "1":
            pytest.fail(f"CI (MINIRL_CI=1) must run the site test, but {missing} is not installed")
        pytest.skip(f"{missing} not installed; CI installs it and runs this test")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="minirl-chromium-")
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    chrome.set_page_load_timeout(60)
    yield chrome
    chrome.quit()
    shutil.rmtree(profile, ignore_errors=True)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve(site: Path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def expected_images(site: Path, page: Path, copies: Path) -> int:
    """How many figures the notebook behind a page drew (0 for a page that is not a notebook)."""
    stem = page.parent.name if page.parent.parent == site / "notebooks" else None
    source = copies / f"{stem}.ipynb" if stem else None
    if source is None or not source.exists():
        return 0
    nb = json.loads(source.read_text())
    return sum(any(k in o.get("data", {}) for k in ("image/png", "image/jpeg"))
               for c in nb["cells"] for o in c.get("outputs", []))


def page_problems(chrome, site: Path, copies: Path) -> dict[str, list[str]]:
    """Load every page of `site`; for each page, what is wrong with it (empty when it loaded with its images)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    server = serve(site)
    problems = {}
    try:
        for page in sorted(site.rglob("*.html")):
            name = page.relative_to(site).as_posix()
            chrome.get(f"http://127.0.0.1:{server.server_port}/{name}")
            try:  # get() returns on the load event; wait for the document itself as well
                WebDriverWait(chrome, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
            except TimeoutException:
                pass  # reported below
            state = chrome.execute_script(PAGE_STATE)
            wrong = []
            if state["state"] != "complete" or state["status"] not in (200, None):
                wrong.append(f"did not load (readyState {state['state']}, HTTP {state['status']})")
            wrong += [f"failed to load {url}" for url in state["failed"]]
            wrong += [f"image not drawn: {i['src']}" for i in state["images"] if not i["complete"] or i["width"] <= 0]
            figures = expected_images(site, page, copies)
            drawn = sum(i["complete"] and i["width"] > 0 for i in state["images"])
            if figures and drawn < figures:
                wrong.append(f"{drawn} images drawn, the notebook plotted {figures}")
            if page.parent.parent == site / "notebooks" and state["cells"] == 0:
                wrong.append("no notebook cells on the page")
            problems[name] = wrong
    finally:
        server.shutdown()
    return problems


def test_site_of_the_synthetic_render_loads_with_its_figure(rendered, browser):
    root, _ = rendered
    problems = page_problems(browser, root / "site", root / "docs" / "notebooks")
    assert {"index.html", "notebooks/90_plot/index.html", "notebooks/91_text/index.html"} <= set(problems)
    assert problems == {name: [] for name in problems}


def test_site_of_the_committed_copies_loads_with_its_images(browser, tmp_path):
    """What CI checks: the site built from docs/ (as committed) loads, every page with its images."""
    site = tmp_path / "site"
    render_tool.build_site(REPO, site, write_index=False)
    problems = page_problems(browser, site, REPO / "docs" / "notebooks")
    copies = sorted((REPO / "docs" / "notebooks").glob("*.ipynb"))
    assert {f"notebooks/{c.stem}/index.html" for c in copies} <= set(problems)
    assert problems == {name: [] for name in problems}


def test_page_check_catches_a_broken_image_and_a_missing_figure(browser, tmp_path):
    site, copies = tmp_path / "site", tmp_path / "copies"
    (site / "notebooks" / "90_plot").mkdir(parents=True)
    copies.mkdir()
    (site / "index.html").write_text('<html><body><img src="missing.png"></body></html>')
    (site / "notebooks" / "90_plot" / "index.html").write_text('<html><body><div class="jp-Cell">x</div></body></html>')
    (copies / "90_plot.ipynb").write_text(json.dumps(
        {"cells": [{"cell_type": "code", "outputs": [{"output_type": "display_data", "data": {"image/png": "x"}}]}]}))
    problems = page_problems(browser, site, copies)
    assert any("image not drawn" in p for p in problems["index.html"])
    assert problems["notebooks/90_plot/index.html"] == ["0 images drawn, the notebook plotted 1"]
