"""Whether this run can roll out with vLLM, decided before torch or a model loads.

Hand-written for notebook 04's registration of the "vllm" engine in notebook 01's engine
registry: `vllm_problem` says in one line why `--rollout-engine vllm` cannot run here (vLLM
not installed, a device that is not CUDA, a dtype vLLM does not compute in), or None. Light:
it imports neither torch nor vLLM.
"""

import importlib.util

from minirl.config import RLConfig

VLLM_DTYPES = ("bfloat16", "float16", "float32")   # vLLM's compute dtypes (its FP8 is a quantization mode)
VLLM_INSTALL = "on a CUDA machine run pip install -r requirements-gpu.txt, or use --rollout-engine shared_prefix"


def vllm_problem(config: RLConfig) -> str | None:
    """Why this run cannot roll out with vLLM (not installed, not on CUDA, an FP8 copy), or None; no heavy import."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed; {VLLM_INSTALL}"
    if not config.run.device.startswith("cuda"):
        return (f"vLLM's engine runs on CUDA GPUs and this run's --device is {config.run.device}; pass --device cuda "
                "on a GPU machine, or use --rollout-engine shared_prefix")
    if config.engine_dtype not in VLLM_DTYPES:
        return (f"vLLM computes in {', '.join(VLLM_DTYPES)} (its FP8 is a quantization mode) and --rollout-dtype is "
                f"{config.rollout.rollout_dtype}; pick one of those")
    return None
