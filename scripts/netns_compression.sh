#!/usr/bin/env bash
# Every gradient-sync method run for real and simulated on two ranks in two network namespaces
# joined by a tbf-shaped veth, at each rate (docs/compression.md):
#
#   sudo scripts/netns_compression.sh [BASE_PLAN] [OUT]      # run from the repository root
#   defaults: examples/validation/netns/lstm-compression-dp2.yaml  runs/netns-compression
#   environment: RATES ("100mbit 1gbit 10gbit"), METHODS (every registered one), ITERATIONS (10),
#                WARMUP (2), PYTHON (.venv/bin/python)
#
# The workload is profiled once here (both ranks' processes co-located, analysis/validate.py);
# per rate the namespaces are made, each method's plan (the base plan with that method and the
# link at the rate) runs one rank per namespace, and analysis.validate record compares the run
# with its prediction. OUT/summary.md: predicted vs measured per method and rate, and the ranking.
set -euo pipefail

BASE=${1:-examples/validation/netns/lstm-compression-dp2.yaml}
OUT=${2:-runs/netns-compression}
RATES=${RATES:-"100mbit 1gbit 10gbit"}
ITERATIONS=${ITERATIONS:-10}
WARMUP=${WARMUP:-2}
PYTHON=${PYTHON:-.venv/bin/python}

source "$(dirname "$0")/netns_lib.sh"
netns_require_root
[[ -f $BASE ]] || { echo "error: plan $BASE not found" >&2; exit 2; }
trap netns_cleanup EXIT INT TERM
methods=()
if [[ -n ${METHODS:-} ]]; then read -r -a methods <<< "$METHODS"; fi

mkdir -p "$OUT"
"$PYTHON" -m analysis.validate profile "$BASE" --out "$OUT/base"
for rate in $RATES; do
    netns_up "$rate"
    "$PYTHON" -m analysis.compression_validate plans "$BASE" --rate "$rate" --profile "$OUT/base/profile" \
        --out "$OUT/$rate" \
        ${methods[@]+--methods "${methods[@]}"}
    netns_validate_plans "$PYTHON" "$OUT/$rate" "$OUT/base/profile" "$ITERATIONS" "$WARMUP" || exit 1
    netns_cleanup
done
"$PYTHON" -m analysis.compression_validate summary "$OUT"
