#!/usr/bin/env bash
# Validate a communication-bound regime: two ranks in two network namespaces joined by a veth
# pair whose both ends are shaped to RATE (default 1gbit) with a tbf qdisc (this kernel has no
# netem), against the simulator with a matching cluster link (the plan's intra_node_link).
#
#   sudo scripts/netns_validate.sh [PLAN] [OUT]        # run from the repository root
#   defaults: examples/validation/netns/gpt-net-dp2.yaml  runs/netns-validate
#   environment: RATE (tbf rate, default 1gbit; keep the plan's link in step), ITERATIONS (20),
#                WARMUP (3), PYTHON (.venv/bin/python)
#
# Steps: create the namespaces and the link; profile the workload on this machine (two
# co-located processes, one thread each, see analysis/validate.py); run rank 0 in the first
# namespace and rank 1 in the second with `python -m exec.runtime` (MASTER_ADDR = rank 0's veth
# address, GLOO_SOCKET_IFNAME = the namespace's veth); compare the run record with the
# prediction (analysis.validate.validate_record). Only the addresses and interfaces created here
# are used; the namespaces are deleted on exit, whatever happens.
set -euo pipefail

PLAN=${1:-examples/validation/netns/gpt-net-dp2.yaml}
OUT=${2:-runs/netns-validate}
RATE=${RATE:-1gbit}
ITERATIONS=${ITERATIONS:-20}
WARMUP=${WARMUP:-3}
PYTHON=${PYTHON:-.venv/bin/python}

if [[ $(id -u) -ne 0 ]]; then
    echo "error: network namespaces need root; run with sudo" >&2
    exit 2
fi
[[ -f $PLAN ]] || { echo "error: plan $PLAN not found" >&2; exit 2; }
"$PYTHON" -c "import sys; from sim.plan import Plan; p = Plan.load(sys.argv[1]); sys.exit(0 if p.world_size == 2 else \
    f'error: {sys.argv[1]} has {p.world_size} ranks; this script runs two')" "$PLAN"

source "$(dirname "$0")/netns_lib.sh"
trap netns_cleanup EXIT INT TERM
netns_up "$RATE"
ip -n "$NS0" -br addr show "$VETH0"; ip -n "$NS1" -br addr show "$VETH1"; tc -n "$NS0" qdisc show dev "$VETH0"

mkdir -p "$OUT"
# 1. Profile the workload here (compute only: the cluster link prices communication).
"$PYTHON" -m analysis.validate profile "$PLAN" --out "$OUT"

# 2. Run one rank per namespace.
if ! netns_run "$PYTHON" "$OUT/plan.yaml" "$OUT/run" "$ITERATIONS" "$WARMUP"; then
    echo "error: a rank failed; see $OUT/run/errors" >&2
    exit 1
fi

# 3. Compare the run with the prediction.
"$PYTHON" -m analysis.validate record "$OUT/plan.yaml" "$OUT/run" --profile "$OUT/profile" --out "$OUT/report"
