#!/usr/bin/env bash
# Every embedding-communication plan of examples/validation/embedding/ (dense all-reduce, the
# parameter server, EmbRace sequential and 2D) run for real and simulated on two ranks in two
# network namespaces joined by a tbf-shaped veth, at each rate (docs/embrace.md):
#
#   sudo scripts/netns_embedding.sh [OUT]      # run from the repository root
#   default: runs/netns-embedding
#   environment: PLANS (examples/validation/embedding/*.yaml), RATES ("100mbit 1gbit 10gbit"),
#                ITERATIONS (10), WARMUP (2), PYTHON (.venv/bin/python)
#
# The workload is profiled once here (the dense plan: every plan has the same layers; both ranks'
# processes co-located, analysis/validate.py); per rate the namespaces are made, each plan (its
# link at the rate, the profile) runs one rank per namespace, and analysis.validate record compares
# the run with its prediction. OUT/summary.md: predicted vs measured per method and rate, and the
# ranking.
set -euo pipefail

OUT=${1:-runs/netns-embedding}
RATES=${RATES:-"100mbit 1gbit 10gbit"}
ITERATIONS=${ITERATIONS:-10}
WARMUP=${WARMUP:-2}
PYTHON=${PYTHON:-.venv/bin/python}

source "$(dirname "$0")/netns_lib.sh"
netns_require_root
plans=()
if [[ -n ${PLANS:-} ]]; then read -r -a plans <<< "$PLANS"; else plans=(examples/validation/embedding/*.yaml); fi
for plan in "${plans[@]}"; do [[ -f $plan ]] || { echo "error: plan $plan not found" >&2; exit 2; }; done
trap netns_cleanup EXIT INT TERM

mkdir -p "$OUT"
"$PYTHON" -m analysis.validate profile "${plans[0]}" --out "$OUT/base"
for rate in $RATES; do
    netns_up "$rate"
    "$PYTHON" -m analysis.embedding_validate plans "${plans[@]}" --rate "$rate" --profile "$OUT/base/profile" \
        --out "$OUT/$rate"
    netns_validate_plans "$PYTHON" "$OUT/$rate" "$OUT/base/profile" "$ITERATIONS" "$WARMUP" || exit 1
    netns_cleanup
done
"$PYTHON" -m analysis.embedding_validate summary "$OUT"
