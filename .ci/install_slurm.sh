#!/bin/sh
# Install Slurm and munge (Debian/Ubuntu packages) so that tests/system/test_slurm.py can start its
# one-node test cluster. Idempotent: does nothing when the daemons and sbatch are already installed.
# Needs root (CI containers run as root); without root or apt-get it says so and exits 0: the
# Slurm tests are then skipped with that reason, and .ci/run fails under CI=true.
set -eu
PATH="$PATH:/usr/sbin:/sbin"  # the daemons live there, not always in a user's PATH
if command -v munged >/dev/null 2>&1 && command -v slurmctld >/dev/null 2>&1 \
        && command -v slurmd >/dev/null 2>&1 && command -v sbatch >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm.sh: needs root and apt-get to install slurm-wlm and munge" >&2
    exit 0
fi
echo "installing slurm-wlm and munge (about 30 s)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# The packages' own services are not used: the tests start private daemons with their own config.
apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
