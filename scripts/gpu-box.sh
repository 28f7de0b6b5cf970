#!/usr/bin/env bash
# On the GPU box (torch already installed, no network), e.g. from the checkout's root:
#   bash wheelhouse-py3.12/gpu-box.sh                       install the kit offline, then gpu-check on CUDA
#   bash wheelhouse-py3.12/gpu-box.sh --device cpu --quick --out kit-cpu   the same, the CPU rehearsal
# Arguments go to `python -m fastattn gpu-check`. PYTHON picks the interpreter (default: python3, the image's, else
# python).
# Fails, before gpu-check, if the install changed torch or if the kit does not import.
# fastattn needs data/ and notebooks/ beside it (a checkout): outside one, this sets FASTATTN_ROOT to the
# wheelhouse's fastattn-root/; to run the notebooks on the box likewise: FASTATTN_ROOT=<that folder>.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WH=${WHEELHOUSE:-$HERE}
[ -f "$WH/requirements-nodeps.txt" ] || { echo "no wheelhouse at $WH (set WHEELHOUSE=wheelhouse-pyX.Y)" >&2; exit 2; }
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
torch_version() { "$PYTHON" -c 'import torch; print(torch.__version__)'; }

before=$(torch_version)
"$PYTHON" -m pip install --no-index --find-links "$WH" -r "$WH/requirements.txt"
"$PYTHON" -m pip install --no-index --find-links "$WH" --no-deps -r "$WH/requirements-nodeps.txt"
after=$(torch_version)
[ "$before" = "$after" ] || { echo "[gpu-box] torch changed: $before -> $after" >&2; exit 1; }
# fastattn reads data/ and notebooks/ from its checkout; the wheel has neither. Where the fastattn that runs
# here finds no checkout (and FASTATTN_ROOT is unset), use the copies built with the wheel.
if [ -z "${FASTATTN_ROOT:-}" ] && ! "$PYTHON" -c 'from fastattn.paths import repo_root; repo_root()' 2>/dev/null; then
    export FASTATTN_ROOT=$WH/fastattn-root
fi
# In a checkout's root, `python -m` imports ./fastattn ahead of the installed wheel: this says which one runs.
"$PYTHON" -c "import fastattn, voxcpm, librosa, papermill, nbconvert, ipykernel, ipywidgets, pydantic
from fastattn.paths import repo_root
print('[gpu-box] kit imports; torch', '$after', '| fastattn from', fastattn.__file__, '| data from', repo_root())"
exec "$PYTHON" -m fastattn gpu-check "$@"
