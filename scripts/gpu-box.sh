#!/usr/bin/env bash
# On the GPU box (torch already installed, no network), e.g. from the checkout's root:
#   bash wheelhouse-py3.12/gpu-box.sh                       install the kit offline, then gpu-check's first
#                                                           contact on CUDA within 330 s (GPU_BOX_BUDGET)
#   bash wheelhouse-py3.12/gpu-box.sh --device cpu --quick --out kit-cpu   the same, the CPU rehearsal
#   bash wheelhouse-py3.12/gpu-box.sh --install-only        install, print the Python to run the notebooks with
# Other arguments go to `python -m fastattn gpu-check`. PYTHON picks the interpreter (default: python3, the image's, else
# python).
# Fails, before gpu-check, if the install changed torch (its version or where it loads from) or if the kit
# does not import.
# fastattn needs data/ and notebooks/ beside it (a checkout): outside one, this sets FASTATTN_ROOT to the
# wheelhouse's fastattn-root/; to run the notebooks on the box likewise: FASTATTN_ROOT=<that folder>.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WH=${WHEELHOUSE:-$HERE}
[ -f "$WH/requirements-nodeps.txt" ] || { echo "no wheelhouse at $WH (set WHEELHOUSE=wheelhouse-pyX.Y)" >&2; exit 2; }
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
torch_at() { "$1" -c 'import torch; print(torch.__version__, "at", torch.__path__[0])'; }

# Where the kit goes. PEP 668: an "externally managed" system Python (Ubuntu 24.04's, Debian's) refuses pip
# outside a venv, and some images have no pip at all. So, unless PYTHON already is a venv's, the kit goes into a
# venv that sees the image's packages (--system-site-packages: the box's torch stays the one that runs), at
# GPU_BOX_VENV (default: .venv-gpu-box in this folder, reused by a second try). BREAK_SYSTEM_PACKAGES=1 installs
# into the system Python itself instead, for a box where that is wanted (pip's --break-system-packages).
where=$("$PYTHON" -c 'import importlib.util as u, os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
print("venv" if sys.prefix != sys.base_prefix else "managed" if managed else "system" if u.find_spec("pip") else "nopip")')
before=$(torch_at "$PYTHON")
pipflags=()
if [ "$where" = venv ] || [ "$where" = system ]; then
    KIT=$PYTHON
elif [ "${BREAK_SYSTEM_PACKAGES:-0}" = 1 ] && [ "$where" = managed ]; then
    KIT=$PYTHON; pipflags=(--break-system-packages)
else
    VENV=${GPU_BOX_VENV:-$PWD/.venv-gpu-box}
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
    KIT=$VENV/bin/python
    echo "[gpu-box] $PYTHON is $where: the kit goes into $VENV (a venv over its packages)"
fi
# No pip where the kit goes: the wheelhouse's own pip wheel runs from the file and installs pip there.
if ! "$KIT" -c 'import pip' 2>/dev/null; then
    pipwheel=$(ls "$WH"/pip-*.whl 2>/dev/null | head -1)
    [ -n "$pipwheel" ] || { echo "[gpu-box] $KIT has no pip and $WH has no pip wheel" >&2; exit 2; }
    "$KIT" "$pipwheel/pip" install --quiet --no-index --find-links "$WH" pip
fi
"$KIT" -m pip install "${pipflags[@]}" --no-index --find-links "$WH" -r "$WH/requirements.txt"
"$KIT" -m pip install "${pipflags[@]}" --no-index --find-links "$WH" --no-deps -r "$WH/requirements-nodeps.txt"
after=$(torch_at "$KIT")
[ "$before" = "$after" ] || { echo "[gpu-box] torch changed: $before -> $after" >&2; exit 1; }
PYTHON=$KIT
if [ "${1:-}" = --install-only ]; then echo "[gpu-box] installed; the kit's Python: $PYTHON"; exit 0; fi
# fastattn reads data/ and notebooks/ from its checkout; the wheel has neither. Where the fastattn that runs
# here finds no checkout (and FASTATTN_ROOT is unset), use the copies built with the wheel.
if [ -z "${FASTATTN_ROOT:-}" ] && ! "$PYTHON" -c 'from fastattn.lab.paths import repo_root; repo_root()' 2>/dev/null; then
    export FASTATTN_ROOT=$WH/fastattn-root
fi
# In a checkout's root, `python -m` imports ./fastattn ahead of the installed wheel: this says which one runs.
"$PYTHON" -c "import fastattn, voxcpm, librosa, papermill, nbconvert, ipykernel, ipywidgets, pydantic
from fastattn.lab.paths import repo_root
print('[gpu-box] kit imports; torch', '$after', '| fastattn from', fastattn.__file__, '| data from', repo_root())"
# Compiled kernels are kept across tries (a second try starts warm): inductor's and triton's caches live in
# gpu-box-cache/ here unless set.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/gpu-box-cache/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/gpu-box-cache/triton}
# No argument: the first-contact set within a budget that leaves an 8-10 minute slot room for the install and
# the start, resumable (a second try continues where the first stopped).
if [ $# -eq 0 ]; then
    set -- --quick --budget "${GPU_BOX_BUDGET:-330}" --resume
    rest=1
fi
rc=0
"$PYTHON" -m fastattn gpu-check "$@" || rc=$?
[ -z "${rest:-}" ] || echo "[gpu-box] the first contact ran; the full set, resumed in the same folder:" \
    "bash $0 --budget 0 --resume   (its plan line gives the estimate; --only NAME,... for parts)"
exit $rc
