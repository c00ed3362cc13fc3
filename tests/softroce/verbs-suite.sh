#!/usr/bin/env bash
# Build the verbs suite on the host (compiling inside the emulated VM is far
# too slow) and run it inside the SoftRoCE VM, one test at a time so each
# name prints in order.
#
#   tests/softroce/verbs-suite.sh [extra libtest args...]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

build_start=$(date +%s)
bin=$(cargo test --features verbs --test verbs_suite --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "verbs_suite" and m.get("executable"):
        print(m["executable"])
')
if [ -z "$bin" ]; then
    echo "verbs-suite: building the verbs suite failed; run: cargo test --features verbs --test verbs_suite --no-run" >&2
    exit 1
fi
echo "verbs-suite: built $bin in $(( $(date +%s) - build_start ))s" >&2

exec "$here/run.sh" env RUST_BACKTRACE=1 "$bin" --test-threads=1 "$@"
