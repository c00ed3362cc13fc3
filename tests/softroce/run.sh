#!/usr/bin/env bash
# Run a command inside a throw-away VM with a SoftRoCE device (rxe0 over lo).
#
#   tests/softroce/run.sh CMD [ARGS...]
#
# Installs what it needs when missing (Debian packages, virtme-ng), boots the
# host's Debian kernel under qemu (TCG: nested KVM hangs here) over the host's
# own filesystem (the checkout and target/ are shared read-write), loads
# rdma_rxe, adds rxe0, raises the memlock limit, and runs CMD from the
# checkout. Exits with CMD's exit status.
#
# Fails with a message naming the log when the kernel panics or oopses, when
# the run exceeds SOFTROCE_TIMEOUT seconds (default 1500), or when the VM
# ends without reporting a status. Each run keeps its console log (and the
# VM's dmesg, scanned for oopses too) under tests/softroce/logs/.
#
# Knobs: SOFTROCE_TIMEOUT, SOFTROCE_KERNEL (a /boot/vmlinuz-*),
# SOFTROCE_MEMORY (5G: the 16 MiB payloads over 100 connections register
# 1.6 GB on each side), SOFTROCE_CPUS (2). Every MWCAP_* variable of the
# host's environment but a key is exported inside the VM (it inherits no
# other).
set -euo pipefail

if [ $# -eq 0 ]; then
    echo "usage: $0 CMD [ARGS...]" >&2
    exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
timeout_s=${SOFTROCE_TIMEOUT:-1500}
mem=${SOFTROCE_MEMORY:-5G}
cpus=${SOFTROCE_CPUS:-2}

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo -n); fi

ensure_packages() {
    local want=(qemu-system-x86 linux-image-amd64 busybox-static bc rdma-core ibverbs-providers ibverbs-utils
        libibverbs-dev librdmacm-dev perftest cmake libclang-dev pkg-config)
    local missing=()
    for p in "${want[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "softroce: installing ${missing[*]}" >&2
        "${sudo_cmd[@]}" apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    if ! command -v vng >/dev/null 2>&1; then
        echo "softroce: installing virtme-ng" >&2
        pip install -q virtme-ng 2>/dev/null || pip install -q --break-system-packages virtme-ng
    fi
}
ensure_packages

kernel=${SOFTROCE_KERNEL:-$(ls /boot/vmlinuz-* 2>/dev/null | sort -V | tail -n 1)}
if [ -z "$kernel" ] || [ ! -r "$kernel" ]; then
    echo "softroce: no readable kernel in /boot (install linux-image-amd64 or set SOFTROCE_KERNEL)" >&2
    exit 2
fi

logs="$here/logs"
mkdir -p "$logs"
run_id="$(date +%Y%m%d-%H%M%S)-$$"
log="$logs/$run_id.log"
status="$logs/$run_id.status"
inner="$logs/$run_id.inner.sh"
marker="MWCAP_SOFTROCE_STATUS"

# The command, quoted for the inner shell.
cmd=$(printf '%q ' "$@")
# The VM does not inherit the host's environment: pass on every MWCAP_*
# variable (test knobs such as MWCAP_VERBS_TORTURE_CALLS, MWCAP_BENCH), but
# never one holding a key (MWCAP_KEY): the inner script stays in logs/ when
# a run fails.
pass_env=""
for name in $(compgen -e | grep '^MWCAP_' | grep -v 'KEY' || true); do
    pass_env+="export $name=$(printf '%q' "${!name}")"$'\n'
done
cat >"$inner" <<INNER
#!/bin/bash
cd $(printf '%q' "$root")
$pass_env
echo "softroce: kernel \$(uname -r), setting up rxe0"
if ! { modprobe rdma_rxe && rdma link add rxe0 type rxe netdev lo; }; then
    echo "softroce: could not set up rxe0"
    echo 125 > $(printf '%q' "$status")
    echo "$marker=125"
    exit 0
fi
ulimit -l unlimited
echo "softroce: running: $cmd"
$cmd
rc=\$?
dmesg > $(printf '%q' "$logs/$run_id.dmesg") 2>&1
echo \$rc > $(printf '%q' "$status")
echo "$marker=\$rc"
INNER

echo "softroce: booting $(basename "$kernel") (log: $log)" >&2
start=$(date +%s)
set +e
timeout -k 15 "$timeout_s" vng --disable-kvm -r "$kernel" --rw --memory "$mem" --cpus "$cpus" \
    --exec "bash $inner" </dev/null >"$log" 2>&1
vng_rc=$?
set -e
elapsed=$(( $(date +%s) - start ))
# Show the run's output (without the console's colour escapes).
sed -e 's/\x1b\[[0-9;]*[A-Za-z]//g' "$log" | grep -av "^\s*$" || true

if grep -aqE "Kernel panic|BUG:|Oops|RIP:" "$log"; then
    echo "softroce: FAILED: the VM kernel panicked or oopsed (see $log)" >&2
    grep -anE "Kernel panic|BUG:|Oops|RIP:" "$log" | head -n 5 >&2
    exit 3
fi
dmesg_file="$logs/$run_id.dmesg"
if [ -s "$dmesg_file" ]; then
    if grep -aqE "Kernel panic|BUG:|Oops" "$dmesg_file"; then
        echo "softroce: FAILED: the VM kernel oopsed (see $dmesg_file)" >&2
        grep -anE "Kernel panic|BUG:|Oops" "$dmesg_file" | head -n 5 >&2
        exit 3
    fi
    warnings=$(grep -acE "WARNING:|rxe.*(timed out|error)" "$dmesg_file" || true)
    if [ "$warnings" -gt 0 ]; then
        echo "softroce: note: $warnings kernel warning line(s) in $dmesg_file" >&2
    fi
fi
if [ "$vng_rc" -eq 124 ] || [ "$vng_rc" -eq 137 ]; then
    echo "softroce: FAILED: no result after ${timeout_s}s, the VM or the command hung (see $log)" >&2
    exit 4
fi
rc=""
if [ -s "$status" ]; then
    rc=$(tr -dc '0-9' <"$status")
else
    rc=$(sed -e 's/\x1b\[[0-9;]*[A-Za-z]//g' "$log" | grep -ao "$marker=[0-9]*" | tail -n 1 | cut -d= -f2 || true)
fi
if [ -z "$rc" ]; then
    echo "softroce: FAILED: the VM ended without reporting a status (vng exit $vng_rc; see $log)" >&2
    exit 5
fi
echo "softroce: command exited with $rc after ${elapsed}s in the VM run (log: $log)" >&2
rm -f "$inner"
exit "$rc"
