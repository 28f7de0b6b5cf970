#!/usr/bin/env bash
# Print a command for Python X.Y: pythonX.Y on PATH, else the newest pyenv install of X.Y
# (a pyenv shim refuses a version that is not selected).   scripts/find-python.sh 3.12
set -euo pipefail
PY=${1:?usage: scripts/find-python.sh X.Y}
if "python$PY" -c '' 2>/dev/null; then echo "python$PY"; exit 0; fi
if command -v pyenv >/dev/null; then
    v=$(pyenv versions --bare | grep -E "^${PY//./\\.}\.[0-9]+$" | sort -V | tail -1 || true)
    if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python$PY"; exit 0; fi
fi
echo "no Python $PY found (neither python$PY on PATH nor a pyenv install)" >&2
exit 2
