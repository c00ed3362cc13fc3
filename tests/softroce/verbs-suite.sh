#!/usr/bin/env bash
# Build the verbs suite on the host (compiling inside the emulated VM is far
# too slow) and run it inside the SoftRoCE VM, one test at a time so each
# name prints in order.
#
# After the suite, in the same VM, `mwcap probe --device rxe0` must report
# type-2 windows usable and window bounds not enforced (rxe's deviation).
#
#   tests/softroce/verbs-suite.sh [extra libtest args...]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

build_start=$(date +%s)
build_log=$(mktemp)
trap 'rm -f "$build_log"' EXIT
bin=$(cargo test --features verbs --test verbs_suite --no-run --message-format=json-render-diagnostics 2>"$build_log" |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "verbs_suite" and m.get("executable"):
        print(m["executable"])
') || true
if [ -z "$bin" ]; then
    cat "$build_log" >&2
    echo "verbs-suite: building the verbs suite failed (output above)" >&2
    exit 1
fi
echo "verbs-suite: built $bin in $(( $(date +%s) - build_start ))s" >&2

# Release: the VM runs the benchmarks (mwcap serve/bench next to perftest)
# with this binary, and users run release builds.
cargo build --release --quiet -p mwcap-cli --features verbs
# A copy, so that a later default-feature build cannot replace it under the VM.
mwcap_bin="$root/target/mwcap-verbs"
cp "$root/target/release/mwcap" "$mwcap_bin"

# examples/delegate.rs's three roles (storage, client, compute) run as
# processes in the VM: delegation on rxe0, every byte checked.
cargo build --release --quiet -p mwcap --features verbs --example delegate
export MWCAP_DELEGATE_BIN="$root/target/mwcap-delegate"
cp "$root/target/release/examples/delegate" "$MWCAP_DELEGATE_BIN"

# RUSTC_BOOTSTRAP lets the stable libtest print each test's time (--report-time).
"$here/run.sh" bash "$here/in-vm.sh" "$bin" "$mwcap_bin" "$@"
