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

TAG=ptw$$                      # unique per invocation; interface names stay under 15 characters
NS0=${TAG}a NS1=${TAG}b
VETH0=${TAG}v0 VETH1=${TAG}v1
ADDR0=10.231.$(( $$ % 250 )).1 ADDR1=10.231.$(( $$ % 250 )).2
PORT=$(( 29500 + $$ % 400 ))
PIDS=()

cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    ip netns del "$NS0" 2>/dev/null || true   # deleting a namespace removes its veth end, and the pair
    ip netns del "$NS1" 2>/dev/null || true
}
trap cleanup EXIT INT TERM

ip netns add "$NS0"
ip netns add "$NS1"
ip link add "$VETH0" type veth peer name "$VETH1"
ip link set "$VETH0" netns "$NS0"
ip link set "$VETH1" netns "$NS1"
ip -n "$NS0" addr add "$ADDR0/24" dev "$VETH0"
ip -n "$NS1" addr add "$ADDR1/24" dev "$VETH1"
for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
ip -n "$NS0" link set "$VETH0" up
ip -n "$NS1" link set "$VETH1" up
# Egress shaping on both ends: each direction runs at RATE. burst must hold at least one
# timer tick's worth of bytes at RATE; latency bounds the queue.
tc -n "$NS0" qdisc add dev "$VETH0" root tbf rate "$RATE" burst 256kb latency 200ms
tc -n "$NS1" qdisc add dev "$VETH1" root tbf rate "$RATE" burst 256kb latency 200ms
echo "namespaces $NS0 ($ADDR0) and $NS1 ($ADDR1), veth shaped to $RATE"
ip -n "$NS0" -br addr show "$VETH0"; ip -n "$NS1" -br addr show "$VETH1"; tc -n "$NS0" qdisc show dev "$VETH0"

mkdir -p "$OUT"
# 1. Profile the workload here (compute only: the cluster link prices communication).
"$PYTHON" -m analysis.validate profile "$PLAN" --out "$OUT"

# 2. Run one rank per namespace.
for rank in 0 1; do
    ns=$NS0 ifname=$VETH0
    if [[ $rank -eq 1 ]]; then ns=$NS1 ifname=$VETH1; fi
    ip netns exec "$ns" env RANK=$rank WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR="$ADDR0" MASTER_PORT=$PORT \
        GLOO_SOCKET_IFNAME="$ifname" \
        "$PYTHON" -m exec.runtime "$OUT/plan.yaml" --out "$OUT/run" --iterations "$ITERATIONS" \
        --warmup "$WARMUP" --backend gloo &
    PIDS+=($!)
done
status=0
for pid in "${PIDS[@]}"; do wait "$pid" || status=$?; done
PIDS=()
if [[ $status -ne 0 ]]; then
    echo "error: a rank failed (exit $status); see $OUT/run/errors" >&2
    exit 1
fi

# 3. Compare the run with the prediction.
"$PYTHON" -m analysis.validate record "$OUT/plan.yaml" "$OUT/run" --profile "$OUT/profile" --out "$OUT/report"
