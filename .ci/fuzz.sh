#!/usr/bin/env bash
# Smoke-run every cargo-fuzz target in fuzz/ for FUZZ_SECONDS (default 30)
# each; exit non-zero on a crash, a leak, a timeout or a build failure.
#
# cargo-fuzz needs nightly-only flags (-Zsanitizer); like rustls's CI we use
# the stable toolchain with RUSTC_BOOTSTRAP=1. New corpus entries go to a
# temporary directory: the committed seeds under fuzz/corpus/ stay as they are.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${FUZZ_SECONDS:-30}
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

echo "fuzz: building targets"
cargo fuzz build

# No target at all (or no list) is a failure, not a smoke run of nothing.
targets=$(cargo fuzz list) || { echo "fuzz: cargo fuzz list failed"; exit 1; }
if [ -z "$targets" ]; then
    echo "fuzz: cargo fuzz list names no target"
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
ran=0
for target in $targets; do
    ran=$((ran + 1))
    corpus=("$work/$target")
    mkdir -p "$work/$target"
    if [ -d "fuzz/corpus/$target" ]; then
        corpus+=("fuzz/corpus/$target")
    fi
    echo "fuzz: running $target for ${secs}s"
    log="$work/$target.log"
    if cargo fuzz run "$target" "${corpus[@]}" -- -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1; then
        # The last status line: "#runs DONE cov: .. ft: .. corp: .. exec/s: ..".
        done_line=$(grep -a 'DONE' "$log" | tail -n 1 || true)
        runs=$(grep -a 'stat::number_of_executed_units' "$log" | awk '{print $2}' || true)
        rate=$(grep -a 'stat::average_exec_per_sec' "$log" | awk '{print $2}' || true)
        echo "fuzz: $target ok: ${runs:-?} runs, ${rate:-?} exec/s; ${done_line}"
    else
        status=1
        echo "fuzz: $target FAILED; log follows (crash inputs are in fuzz/artifacts/$target/)"
        tail -n 60 "$log"
    fi
done
echo "fuzz: $ran targets run"
exit "$status"
