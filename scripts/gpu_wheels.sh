#!/usr/bin/env bash
# Wheels for a GPU machine with no network (scripts/gpu_check.sh installs them from .whl/): the packages
# paratwin's check needs beyond what a CUDA PyTorch image usually holds (torch, numpy, pandas, pyarrow,
# scipy, matplotlib, pyyaml come with it). Versions: this checkout's environment, so both machines run the
# same simulator. Python and platform of the GPU machine: PY_VERSION (default 3.12), manylinux x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PY_VERSION=${PY_VERSION:-3.12}
mkdir -p .whl
for package in simpy pydantic pydantic_core annotated_types typing_inspection typing_extensions; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$package")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${package//_/-}==$version"
done
ls .whl
