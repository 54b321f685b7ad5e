#!/usr/bin/env bash
# Every embedding-communication plan of examples/validation/embedding/ (dense all-reduce, the
# parameter server, EmbRace sequential and 2D) run for real and simulated on two ranks in two
# network namespaces joined by a tbf-shaped veth, at each rate (docs/embrace.md):
#
#   sudo scripts/netns_embedding.sh [OUT]      # run from the repository root
#   default: runs/netns-embedding
#   environment: PLANS (examples/validation/embedding/*.yaml), RATES ("100mbit 1gbit 10gbit"),
#                ITERATIONS (10), WARMUP (2), PYTHON (.venv/bin/python),
#                PROFILE (a bundle of this workload to reuse; default: profile it here, OUT/base),
#                COMMBENCH (1: benchmark the link; 0: price it from the tbf rate alone),
#                COMM_REPEATS (10), COMM_ONLY (1: the benchmarks only, no plan runs),
#                ROUNDS (1: each plan once; R > 1: R interleaved rounds, analysis.rounds), SEED (12: their order)
#
# The workload is profiled once here (the dense plan: every plan has the same layers; both ranks'
# processes co-located, analysis/validate.py). Per rate the namespaces are made; exec.commbench runs
# one rank per namespace over the plans' message sizes, as the loopback suite benchmarks loopback
# (analysis.netns_comm): OUT/<rate>/comm holds its samples, fits and spec.md, OUT/<rate>/profile a
# copy of the profile with those fits, which price every collective and message of that rate's
# plans (sim.comm.ClusterComm; the tbf rate alone would miss veth, tbf and TCP on the CPUs). Then
# each plan (its link at the rate, that profile) runs one rank per namespace, and
# analysis.validate record compares the run with its prediction. OUT/summary.md: predicted vs
# measured per method and rate, and the ranking.
set -euo pipefail

OUT=${1:-runs/netns-embedding}
RATES=${RATES:-"100mbit 1gbit 10gbit"}
ITERATIONS=${ITERATIONS:-10}
WARMUP=${WARMUP:-2}
PYTHON=${PYTHON:-.venv/bin/python}
COMMBENCH=${COMMBENCH:-1}
COMM_REPEATS=${COMM_REPEATS:-10}
COMM_ONLY=${COMM_ONLY:-0}
ROUNDS=${ROUNDS:-1}
SEED=${SEED:-12}

source "$(dirname "$0")/netns_lib.sh"
netns_require_root
plans=()
if [[ -n ${PLANS:-} ]]; then read -r -a plans <<< "$PLANS"; else plans=(examples/validation/embedding/*.yaml); fi
for plan in "${plans[@]}"; do [[ -f $plan ]] || { echo "error: plan $plan not found" >&2; exit 2; }; done
trap netns_cleanup EXIT INT TERM

mkdir -p "$OUT"
base=${PROFILE:-$OUT/base/profile}
if [[ -z ${PROFILE:-} ]]; then "$PYTHON" -m analysis.validate profile "${plans[0]}" --out "$OUT/base"; fi
for rate in $RATES; do
    netns_up "$rate"
    profile=$base
    if [[ $COMMBENCH -eq 1 || $COMM_ONLY -eq 1 ]]; then
        echo "== $OUT/$rate commbench"
        netns_commbench "$PYTHON" "$base" "$OUT/$rate" "$COMM_REPEATS" "${plans[@]}" || exit 1
        profile=$OUT/$rate/profile
    fi
    if [[ $COMM_ONLY -ne 1 ]]; then
        "$PYTHON" -m analysis.embedding_validate plans "${plans[@]}" --rate "$rate" --profile "$profile" \
            --out "$OUT/$rate"
        netns_validate_plans "$PYTHON" "$OUT/$rate" "$profile" "$ITERATIONS" "$WARMUP" "$ROUNDS" "$SEED" \
            || exit 1
    fi
    netns_cleanup
done
if [[ $COMM_ONLY -ne 1 ]]; then
    "$PYTHON" -m analysis.embedding_validate summary "$OUT"
    if [[ $ROUNDS -gt 1 ]]; then "$PYTHON" -m analysis.rounds show "$OUT"; fi
fi
