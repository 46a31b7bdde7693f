"""Make trl, ray and vllm look uninstalled in every Python process started with this directory on PYTHONPATH.

tests/gpu/run.sh puts it there in its CPU rehearsal, so that the rehearsal imports exactly
what the GPU machine has (torch, transformers, peft and accelerate; not trl, ray or vllm).
Python imports `sitecustomize` at startup from the path, so torchrun's children are covered
too. The packages are hidden from the path finder, as if their directories were not in
site-packages: `import vllm` raises ModuleNotFoundError, `importlib.util.find_spec("vllm")`
is None and `importlib.metadata.version("vllm")` raises PackageNotFoundError, which is what
libraries test. MINIRL_ABSENT names the packages (comma-separated). The interpreter's own
sitecustomize, if it has one, runs after this one.
"""

import importlib.machinery
import importlib.util
import os
import sys

ABSENT = tuple(name for name in os.environ.get("MINIRL_ABSENT", "trl,ray,vllm").split(",") if name)


def _absent(name: str) -> bool:
    return name.split(".")[0].replace("-", "_").lower() in ABSENT


class HiddenPathFinder:
    """sys.meta_path's PathFinder, blind to the packages in ABSENT (their modules and their metadata)."""

    def find_spec(self, name, path=None, target=None):
        return None if _absent(name) else importlib.machinery.PathFinder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        for dist in importlib.machinery.PathFinder.find_distributions(*args, **kwargs):
            if not _absent(dist.metadata["Name"] or ""):
                yield dist

    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()


sys.meta_path[:] = [HiddenPathFinder() if finder is importlib.machinery.PathFinder else finder
                    for finder in sys.meta_path]

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _spec is not None and _spec.loader is not None:          # the interpreter's own, shadowed by this one
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
