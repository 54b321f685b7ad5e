#!/usr/bin/env bash
# The one-GPU check (issue 9; scripts/gpu_check.py): run it on a machine with a CUDA GPU and a CUDA
# build of torch already installed. Profiles, predicts, runs and compares; results under
# ${OUT:-runs/gpu_check}. Under 8 minutes on an H200. CI never runs it.
#
# What the check imports and the GPU's Python lacks comes from .whl/ when that folder holds wheels
# (scripts/gpu_wheels.sh fetches them on a machine with a network: a GPU machine without one), else from
# `pip install -e .`, which keeps the torch already installed (the pyproject accepts any recent torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: gpu_check needs one')"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import analysis.validation.run, sim.simulate" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/paratwin-site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/paratwin-site
  else
    "$PY" -m pip install -q -e .
  fi
fi
"$PY" scripts/gpu_check.py --out "${OUT:-runs/gpu_check}" "$@"
