"""`import minirl` and every module a GPU check needs work without trl, ray or vllm installed.

A GPU machine may hold only torch, transformers, peft and accelerate (tests/gpu/run.sh runs
there): only the Ray controller (stage 6) and the Ray producers need ray, only the vLLM engine
needs vllm, only the benchmarks and parity tests need trl.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDS_RAY = ("minirl.controller", "minirl.runtime.async_ray",    # Ray actors, through and through, and the
             "minirl.runtime.driver_run", "minirl.runtime.object_store_sync",   # controller's plumbing
             "minirl.runtime.ray_calls", "minirl.runtime.ray_start", "minirl.runtime.role_checkpoints",
             "minirl.runtime.source_rows", "minirl.runtime.reservations")

BLOCKER = '''
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("ray", "trl", "vllm"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, Absent())
'''


def test_every_module_but_the_ray_controller_imports_without_trl_ray_or_vllm():
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for p in (ROOT / "minirl").rglob("*.py"))
    wanted = [m for m in modules if not m.startswith(NEEDS_RAY)]
    code = BLOCKER + "import importlib\nfailed = []\n" + \
        f"for m in {wanted!r}:\n    try:\n        importlib.import_module(m)\n" + \
        "    except ModuleNotFoundError as e:\n        failed.append(f'{m}: {e}')\nprint('\\n'.join(failed))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", "modules that need trl, ray or vllm at import:\n" + out.stdout
