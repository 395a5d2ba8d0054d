#!/usr/bin/env bash
# Installs everything slurm-mig needs on a fresh Debian 12 machine, idempotently:
# the Python virtual environment with the package and its test extras, and (as root)
# Debian's Slurm and MUNGE packages for the local demo/test cluster.
#   scripts/bootstrap.sh              runtime + tests (what `make demo` needs)
#   scripts/bootstrap.sh --training   also torch (CPU) and the RL training stack (`make test` runs a
#                                     smoke training run)
set -euo pipefail
cd "$(dirname "$0")/.."

# A venv without pip (Debian without python3-venv: ensurepip missing) is made again, not reused.
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    rm -rf .venv
    if ! python3 -m venv .venv >/dev/null 2>&1; then
        rm -rf .venv
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "python3 -m venv failed: installing Debian's python3-venv" >&2
            apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends python3-venv >/dev/null
            python3 -m venv .venv
        else
            echo "python3 -m venv failed: install python3-venv (Debian: apt-get install python3-venv) and rerun" >&2
            exit 1
        fi
    fi
fi
# -c constraints.txt: the tested versions of every package (pyproject.toml keeps the ranges).
# PIP_CONSTRAINT too: pip's isolated build of our own package (setuptools, the build backend) ignores -c.
# As a file: URL: pip splits the variable on whitespace, so a checkout path with a space in it would name
# files that do not exist and fail every install below; the URL has it percent-encoded.
PIP_CONSTRAINT="$(python3 -c 'import pathlib, sys; print(pathlib.Path(sys.argv[1]).absolute().as_uri())' \
    "$PWD/constraints.txt")"
export PIP_CONSTRAINT
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt)
if [ "${1:-}" = "--training" ]; then
    # torch first and pinned: the CPU wheel; an unpinned torch would pull several GB of CUDA packages.
    "${pip[@]}" torch==2.13.0
    "${pip[@]}" -e '.[test,plot,train]'
else
    "${pip[@]}" -e '.[test,plot]'
fi

# The local cluster's own code installs Slurm if missing; doing it here too means the
# first test or demo run does not pay for it in the middle of its output.
if [ "$(id -u)" = 0 ]; then
    .venv/bin/python -m slurm_mig.slurm.localcluster --install-only
fi
# The test suite's own tools (lua5.1 runs job_submit.lua, tmux hosts the dashboard's test), installed here
# and not first by the tests: `make test` runs the Slurm tests beside the others, and two apt-gets at
# once fail on apt's lock. The tests still install a missing one, or skip.
if [ "${1:-}" = "--training" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=()
    command -v lua5.1 >/dev/null || missing+=(lua5.1)
    command -v tmux >/dev/null || missing+=(tmux)
    if [ "${#missing[@]}" -gt 0 ]; then
        apt_install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}")
        "${apt_install[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && "${apt_install[@]}" >/dev/null; } \
            || echo "warning: apt-get install ${missing[*]} failed; the tests that need them will try again or skip" >&2
    fi
fi
# The markers make skips install steps: only a run that got this far may leave them.
if [ "${1:-}" = "--training" ]; then
    touch .venv/.installed-training
fi
touch .venv/.installed
