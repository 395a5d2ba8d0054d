#!/usr/bin/env bash
# Installs everything slurm-mig needs on a fresh Debian 12 machine, idempotently:
# the Python virtual environment with the package and its test extras, and (as root)
# Debian's Slurm and MUNGE packages for the local demo/test cluster.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,plot]'

# The local cluster's own code installs Slurm if missing; doing it here too means the
# first test or demo run does not pay for it in the middle of its output.
if [ "$(id -u)" = 0 ]; then
    .venv/bin/python -m slurm_mig.slurm.localcluster --install-only
fi
touch .venv/.installed
