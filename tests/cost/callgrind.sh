#!/usr/bin/env bash
# Instructions per call, per side, of mwcap (the connection layer, the
# engines, the async driver and hand-over, and the std code they call:
# allocation, hashing, copies, the executor), with the simulated NIC
# excluded, counted with callgrind through the async API.
#
#   tests/cost/callgrind.sh [CASE...]      (CASE: rpc, mw, confirm; default all)
#
# Also prints the sans-IO layer alone (examples/proto_cost.rs), see the end.
#
# The simulator is reached only through the `Nic` trait, so its cost is the
# inclusive cost of `<SimNic as NicOps>::*`; mwcap's is the program total minus
# that. Two runs of the same binary (N1 and N2 measured calls after the same
# warm-up) are subtracted, so setup and teardown cancel out, and the
# difference is divided by the calls and by 2 (client and server). The
# driver's busy-poll is off in the example, so spinning is not counted.
# Prints one machine-readable line per case (`cost case=...`), then the
# example's own counts for each side (`cost: CASE: ...`: driver loops,
# connection turns and sleeps per call, warm-up calls included).
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v valgrind >/dev/null || { echo "cost: valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
cargo build --release --quiet --example call_cost --example proto_cost
bin=target/release/examples/call_cost
n1=${COST_N1:-500}
n2=${COST_N2:-1500}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(rpc mw confirm)
# Each side's connection on an Endpoint of its own, as every connection
# is (`mode=endpoint` in the output).
mode=endpoint
for c in "${cases[@]}"; do
    for n in "$n1" "$n2"; do
        valgrind --tool=callgrind --callgrind-out-file="$work/$c.$n.out" "$bin" "$c" "$n" >"$work/$c.$n.stdout" 2>"$work/$c.$n.log"
        callgrind_annotate --inclusive=yes --threshold=100 "$work/$c.$n.out" >"$work/$c.$n.txt" 2>/dev/null
    done
    PYTHONPATH=tests/cost python3 - "$work/$c.$n1.txt" "$work/$c.$n2.txt" "$c" "$n1" "$n2" "$mode" <<'PY'
import re, sys
from annotate import rows
def costs(path):
    total, sim = 0, {}
    for ir, rest in rows(path):
        if rest.startswith("PROGRAM TOTALS"):
            total = ir
            continue
        f = re.search(r"<mwcap::sim::nic::SimNic as mwcap::backend::ops::NicOps>::(\w+)", rest)
        if f and not rest.startswith("=>"):
            sim[f.group(1)] = max(sim.get(f.group(1), 0), ir)
    return total, sum(sim.values())
(t1, s1), (t2, s2) = costs(sys.argv[1]), costs(sys.argv[2])
case, n1, n2, mode = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
calls = n2 - n1
if s1 == 0 or s2 == 0:
    sys.exit(f"cost: no <SimNic as NicOps> frame found in the {case} profile: did the trait's path change? "
             "update the pattern in tests/cost/callgrind.sh")
mw = ((t2 - s2) - (t1 - s1)) / calls / 2
print(f"cost case={case} mode={mode} mwcap_ir_per_call_per_side={mw:.0f} sim_ir_per_call={(s2 - s1) / calls:.0f} total_ir_per_call={(t2 - t1) / calls:.0f}")
PY
    # How the calls ran (the example's own counts, from the longer run):
    # driver loops, connection turns and sleeps per call on each side, which
    # a change to the driver's loop moves before the instructions show it.
    grep -a '^call_cost: .* endpoint: ' "$work/$c.$n2.stdout" | sed -e "s/^call_cost: /cost: $c: /" || true
done

# The sans-IO layer alone: examples/proto_cost.rs runs two proto::Connections
# whose commands it carries out on byte vectors (no Nic, no simulator, no
# executor); the difference of two runs, per call and side, is the protocol
# layer and its engines plus that minimal harness (about 1,000 instructions
# a call per side: its copies of frames and payloads, and its queues).
for c in "${cases[@]}"; do
    for n in "$n1" "$n2"; do
        valgrind --tool=callgrind --callgrind-out-file="$work/p.$c.$n.out" \
            target/release/examples/proto_cost "$c" "$n" >/dev/null 2>"$work/p.$c.$n.log"
    done
    t1=$(callgrind_annotate "$work/p.$c.$n1.out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
    t2=$(callgrind_annotate "$work/p.$c.$n2.out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
    echo "cost case=$c layer=proto ir_per_call_per_side=$(( (t2 - t1) / (n2 - n1) / 2 ))"
done
