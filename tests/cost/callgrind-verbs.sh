#!/usr/bin/env bash
# Instructions per call over real verbs, counted with callgrind: everything
# in user space (mwcap, its verbs backend, libibverbs and the provider,
# libc), one call and both sides (one process: `mwcap bench --device DEV`
# with client and server on two protection domains, block_on, both drivers
# sleeping on the completion channel between calls).
#
#   tests/cost/callgrind-verbs.sh MWCAP_BINARY [DEVICE]      (needs RDMA: the VM)
#
# tests/softroce/in-vm.sh runs it on rxe0 (informational). Where
# tests/cost/callgrind.sh counts mwcap over the simulated NIC (the NIC
# excluded), this counts the path users run on a device: the backend's
# posts and polls (src/verbs/), and what libibverbs and the provider cost
# in user space. The kernel's share (rxe's work, system calls) is not
# counted. How many times the drivers loop, sleep and wake a call depends on
# timing, so the figures move from run to run: two runs of one binary gave
# rpc 19,863 and 22,073, the 4 KiB confirm read 42,794 and 45,855. Compare
# the parts a change should move (provider and libc for system calls, verbs
# for the backend), or several runs.
#
# Two runs of the same case (N1 and N2 timed calls after the same warm-up)
# are subtracted, so setup and teardown cancel out; prints one line per
# case, with the total split by where the instructions are: conn (the code
# of src/conn, and the std and dependency code inlined into its functions),
# verbs (the same for src/verbs), provider (libibverbs and lib*-rdmav*),
# libc, bench (the benchmark's own loop, cli/, with what is inlined into
# it), and the rest (std and dependency functions of their own: futures'
# joins, parking_lot's slow paths, hashbrown; mwcap's other modules).
# A row of callgrind_annotate is one function of one source file, so code
# inlined from std into `mwcap::conn::...` is a row of its own under std's
# file: it is counted by the function it was inlined into.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=${1:?usage: callgrind-verbs.sh MWCAP_BINARY [DEVICE]}
dev=${2:-rxe0}
command -v valgrind >/dev/null || { echo "cost: valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
n1=${COST_N1:-100}
n2=${COST_N2:-300}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# (rpc runs on the mw connection: it has no policy of its own, policy=none.)
for c in "rpc mw 64" "reply_read mw 4096" "reply_read confirm 4096"; do
    set -- $c
    case_=$1 policy=$2 size=$3
    for n in "$n1" "$n2"; do
        timeout -k 5 600 valgrind --tool=callgrind --callgrind-out-file="$work/$n.out" "$bin" bench --device "$dev" \
            --cases "$case_" --policy "$policy" --sizes "$size" --inflight 1 --iters "$n" --warmup 20 --stamp-only \
            >"$work/$n.log" 2>&1 || {
            echo "cost case=$case_ policy=$policy backend=verbs no result (valgrind exit $?; its log ends:)"
            tail -5 "$work/$n.log" | sed -e 's/^/cost: /'
            continue 2
        }
        callgrind_annotate --auto=no --threshold=100 "$work/$n.out" >"$work/$n.txt" 2>/dev/null
    done
    [ "$case_" = rpc ] && policy=none
    PYTHONPATH="$here" python3 - "$work/$n1.txt" "$work/$n2.txt" "$case_" "$policy" "$size" "$n1" "$n2" <<'PY'
import sys
from annotate import rows
# The benchmark binary is also called `mwcap`: its modules, by name.
BENCH = tuple(f"mwcap::{m}::" for m in ("asyncbench", "bench", "cases", "count", "executors", "main"))
def parts(path):
    out = {"total": 0}
    for ir, rest in rows(path):
        if rest.startswith("PROGRAM TOTALS"):
            out["total"] = ir
            continue
        # Paths under the working directory print relative to it.
        f, _, func = rest.partition(":")
        f = "/" + f
        # The function the code was compiled into (a trait impl's type
        # first): std's and dependencies' code inlined into mwcap's.
        func = func.lstrip("<")
        if "/src/conn/" in f or func.startswith("mwcap::conn::"):
            k = "conn"
        elif "/src/verbs/" in f or func.startswith("mwcap::verbs::"):
            k = "verbs"
        elif "/cli/src/" in f or func.startswith(BENCH) or func.split(" [")[0] == "mwcap::main":
            k = "bench"
        elif "libibverbs" in rest or "rdmav" in rest:
            k = "provider"
        elif "libc.so" in rest:
            k = "libc"
        else:
            continue
        out[k] = out.get(k, 0) + ir
    return out
a, b = parts(sys.argv[1]), parts(sys.argv[2])
case, policy, size, n1, n2 = sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
parts_ = ("conn", "verbs", "provider", "libc", "bench")
per = {k: (b.get(k, 0) - a.get(k, 0)) / (n2 - n1) for k in ("total",) + parts_}
rest = per["total"] - sum(per[k] for k in parts_)
print(f"cost case={case} policy={policy} size={size} backend=verbs ir_per_call={per['total']:.0f} "
      f"conn={per['conn']:.0f} verbs={per['verbs']:.0f} provider={per['provider']:.0f} libc={per['libc']:.0f} "
      f"bench={per['bench']:.0f} rest={rest:.0f}")
PY
done
