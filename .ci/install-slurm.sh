#!/usr/bin/env bash
# Install the Debian packages the `slurm` tests need: bash .ci/install-slurm.sh
# (called by .ci/run). Idempotent and quiet. The tests start and stop the daemons themselves
# (tests/slurm_cluster.py); nothing here starts a service.
# Where the packages cannot be installed (no apt, not root, no network), it says so loudly and
# exits 0: the `slurm` tests then skip with a message that names this script.
set -uo pipefail

PKGS=(slurmctld slurmd slurm-client munge)

have_all() {
    for p in "${PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
    done
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null
}

skip() {
    {
        echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
        echo "!! install-slurm: $1"
        echo "!! SLURM packages (${PKGS[*]}) NOT installed: the 'slurm' tests will SKIP."
        echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
    } >&2
    exit 0
}

if have_all; then
    echo "install-slurm: ${PKGS[*]} already installed"
    exit 0
fi
command -v apt-get >/dev/null || skip "apt-get not found (not a Debian/Ubuntu machine)"

SUDO=()
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        skip "not root and no passwordless sudo"
    fi
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
# The package post-install scripts try to start services; there is no init system, so stop them.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" >/dev/null && "${SUDO[@]}" chmod +x "$policy" && made_policy=1
fi
ok=1
"${SUDO[@]}" apt-get update -qq >"$log" 2>&1 || ok=0
if [ $ok = 1 ]; then
    "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >>"$log" 2>&1 || ok=0
fi
[ $made_policy = 1 ] && "${SUDO[@]}" rm -f "$policy"
if [ $ok = 0 ] || ! have_all; then
    tail -n 20 "$log" >&2
    rm -f "$log"
    skip "apt-get failed (output above)"
fi
rm -f "$log"
echo "install-slurm: installed ${PKGS[*]} ($(slurmctld -V 2>/dev/null))"
