#!/usr/bin/env bash
# The GPU check: every GPU path of minirl once, on one GPU, ending with a summary table.
#
#   tests/gpu/run.sh            # on a CUDA machine (torch, transformers, peft, accelerate; trl, ray, vllm
#                               # not needed): about 5 minutes on one H200, under 10
#   tests/gpu/run.sh --cpu      # the same checks, small, on the CPU: proves the script works (CI)
#   tests/gpu/run.sh --help     # the checks, the options
#
# Training runs as TRL trains on a GPU (--mixed-precision auto): float32 weights and AdamW state, bf16
# products (stages 1 and 7 by autocast, stage 4 by FSDP2's MixedPrecisionPolicy at ZeRO 2/3, stage 6's
# workers by autocast); the stage1 and fsdp2 checks fail unless the runs record it.
# Exits 1 when any check failed, 0 otherwise. Offline: the embedded policy is built locally
# (MINIRL_CACHE, default ~/.cache/minirl) and no hub is reached. Logs, the runs and
# summary.json go to --out (default runs/gpu-check).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python}" tests/gpu/check.py "$@"
