# Shared by scripts/netns_validate.sh, netns_compression.sh and netns_embedding.sh (source it): two network
# namespaces joined by a veth pair whose both ends are shaped with a tbf qdisc (this kernel has no
# netem), and one rank of a 2-rank plan run in each. Only the names and addresses made here are
# used; netns_cleanup deletes them (call it from an EXIT trap).

NETNS_TAG=ptw$$                      # unique per invocation; interface names stay under 15 characters
NS0=${NETNS_TAG}a NS1=${NETNS_TAG}b
VETH0=${NETNS_TAG}v0 VETH1=${NETNS_TAG}v1
ADDR0=10.231.$(( $$ % 250 )).1 ADDR1=10.231.$(( $$ % 250 )).2
NETNS_PORT=$(( 29500 + $$ % 400 ))
NETNS_PIDS=()

netns_require_root() {
    if [[ $(id -u) -ne 0 ]]; then
        echo "error: network namespaces need root; run with sudo" >&2
        exit 2
    fi
}

netns_cleanup() {
    for pid in "${NETNS_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    ip netns del "$NS0" 2>/dev/null || true   # deleting a namespace removes its veth end, and the pair
    ip netns del "$NS1" 2>/dev/null || true
}

# netns_up RATE: the namespaces, the veth pair and its shaping at RATE (tc syntax: 1gbit, 100mbit)
netns_up() {
    local rate=$1
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
    tc -n "$NS0" qdisc add dev "$VETH0" root tbf rate "$rate" burst 256kb latency 200ms
    tc -n "$NS1" qdisc add dev "$VETH1" root tbf rate "$rate" burst 256kb latency 200ms
    echo "namespaces $NS0 ($ADDR0) and $NS1 ($ADDR1), veth shaped to $rate"
}

# netns_pair PYTHON MODULE ARGS...: python -m MODULE ARGS as rank 0 in the first namespace and rank 1
# in the second (torchrun's environment variables), waiting for both
netns_pair() {
    local python=$1
    shift
    for rank in 0 1; do
        local ns=$NS0 ifname=$VETH0
        if [[ $rank -eq 1 ]]; then ns=$NS1 ifname=$VETH1; fi
        ip netns exec "$ns" env RANK=$rank WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR="$ADDR0" \
            MASTER_PORT=$NETNS_PORT GLOO_SOCKET_IFNAME="$ifname" "$python" -m "$@" &
        NETNS_PIDS+=($!)
    done
    local status=0
    for pid in "${NETNS_PIDS[@]}"; do wait "$pid" || status=$?; done
    NETNS_PIDS=()
    NETNS_PORT=$(( NETNS_PORT + 1 ))  # a fresh rendezvous port for the next run
    return $status
}

# netns_run PYTHON PLAN OUT ITERATIONS WARMUP: the plan's two ranks, one per namespace
netns_run() {
    netns_pair "$1" exec.runtime "$2" --out "$3" --iterations "$4" --warmup "$5" --backend gloo
}

# netns_commbench PYTHON PROFILE OUT REPEATS PLAN...: exec.commbench over the link netns_up shaped, at
# the plans' message sizes (analysis.netns_comm); OUT/comm holds the benchmark and OUT/profile a copy of
# PROFILE whose communication fits price the plans' collectives (the loopback suite's way)
netns_commbench() {
    local python=$1 profile=$2 out=$3 repeats=$4
    shift 4
    netns_pair "$python" analysis.netns_comm measure "$@" --profile "$profile" --out "$out/comm" \
        --repeats "$repeats" || return 1
    "$python" -m analysis.netns_comm spec "$out/comm" --profile "$profile" --out "$out/profile"
}

# netns_validate_plans PYTHON DIR PROFILE ITERATIONS WARMUP [ROUNDS SEED]: run every DIR/*.yaml plan (one
# rank per namespace, over the link netns_up shaped) and compare each run with its prediction from
# PROFILE: DIR/<plan>/run and DIR/<plan>/report. ROUNDS > 1 (analysis.rounds): every plan once per
# round, each round in a fresh order drawn from SEED (DIR/rounds-order.json); round 0 is the
# validated run above, round r runs to DIR/<plan>/rounds/r<r>/run; then DIR/rounds.{json,md}, the
# pairs judged by their per-round ratios. ROUNDS 1 (the default): every plan once, in file order.
netns_validate_plans() {
    local python=$1 dir=$2 profile=$3 iterations=$4 warmup=$5 rounds=${6:-1} seed=${7:-12}
    local names=() orders=() plan
    for plan in "$dir"/*.yaml; do names+=("$(basename "$plan" .yaml)"); done
    if [[ $rounds -gt 1 ]]; then
        mapfile -t orders < <("$python" -m analysis.rounds orders "$dir" "${names[@]}" --rounds "$rounds" \
            --seed "$seed" --iterations "$iterations") || return 1
    else
        orders=("${names[*]}")
    fi
    local round=0 order name
    for order in "${orders[@]}"; do
        for name in $order; do
            if [[ $round -eq 0 ]]; then
                echo "== $dir $name"
                if ! netns_run "$python" "$dir/$name.yaml" "$dir/$name/run" "$iterations" "$warmup"; then
                    echo "error: $name failed; see $dir/$name/run/errors" >&2
                    return 1
                fi
                "$python" -m analysis.validate record "$dir/$name.yaml" "$dir/$name/run" --profile "$profile" \
                    --out "$dir/$name/report" > "$dir/$name/report.txt"
                grep -m1 -i "iteration" "$dir/$name/report.txt" || true
            else
                echo "== $dir $name round $((round + 1)) of $rounds"
                if ! netns_run "$python" "$dir/$name.yaml" "$dir/$name/rounds/r$round/run" "$iterations" "$warmup"; then
                    echo "error: $name failed; see $dir/$name/rounds/r$round/run/errors" >&2
                    return 1
                fi
            fi
        done
        round=$((round + 1))
    done
    if [[ $rounds -gt 1 ]]; then "$python" -m analysis.rounds collect "$dir" || return 1; fi
}
