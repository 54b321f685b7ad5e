#!/usr/bin/env bash
# The one-GPU check (issue 9; scripts/gpu_check.py): run it on a machine with a CUDA GPU and a CUDA
# build of torch already installed. Installs paratwin into that environment (torch is left as it is),
# then profiles, predicts, runs and compares; results under ${OUT:-runs/gpu_check}. Under 8 minutes on
# an H200. CI never runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: gpu_check needs one')"
python -m pip install -q -e .  # keeps the torch already installed (pyproject accepts any recent torch)
python scripts/gpu_check.py --out "${OUT:-runs/gpu_check}" "$@"
