#!/usr/bin/env bash
# Side venv with another torch (and Python): core test suite + the GPU kit's CPU rehearsal, or (SUITE=exactness)
# only the exactness contract, recorded under data/results/torch-matrix/.
#   scripts/torch-matrix.sh TORCH [PY [REF]]     e.g.  scripts/torch-matrix.sh 2.11.0 3.12 HEAD
#   SUITE=exactness scripts/torch-matrix.sh 2.5.1     SUITE=install: only create the venv
# Creates .venv-torch<TORCH>-py<PY> (reused while requirements/pyproject are unchanged) with torch==TORCH
# (any pip constraint cleared), requirements.txt minus torch/jupyterlab at their pins, voxcpm --no-deps and
# fastattn --no-deps -e; then runs `pytest -q -m "not slow" tests` and
# `python -m fastattn gpu-check --device cpu --quick --out <fresh temporary folder>`.
# REF (a commit): test a `git archive` export of it instead of the working tree (which may be mid-edit).
# Logs, pip freeze and the JUnit report go to <venv>/matrix-<timestamp>/. Exit 0 only if both passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

TORCH=${1:?usage: scripts/torch-matrix.sh TORCH [PY [REF]]}
PY=${2:-$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')}
REF=${3:-}
VENV=$ROOT/.venv-torch$TORCH-py$PY
SUITE=${SUITE:-full}
case $SUITE in full|exactness|install) ;; *) echo "SUITE must be full, exactness or install, got $SUITE" >&2; exit 2;; esac
export PIP_CONSTRAINT=/dev/null   # the machine-wide cap on torch must not apply (an empty value does not lift it)

STAMP=$VENV/.torch-matrix-installed
if [ ! -f "$STAMP" ] || [ requirements.txt -nt "$STAMP" ] || [ requirements-voxcpm.txt -nt "$STAMP" ] \
        || [ pyproject.toml -nt "$STAMP" ]; then
    set -e
    [ -x "$VENV/bin/python" ] || "$(scripts/find-python.sh "$PY")" -m venv "$VENV"
    pip=("$VENV/bin/python" -m pip install --quiet)
    "${pip[@]}" --upgrade pip
    "${pip[@]}" "torch==$TORCH"
    grep -vE '^(torch|jupyterlab)==' requirements.txt > "$VENV/requirements-matrix.txt"
    echo "torch==$TORCH" > "$VENV/constraints-matrix.txt"   # the rest may never move torch
    "${pip[@]}" -r "$VENV/requirements-matrix.txt" -c "$VENV/constraints-matrix.txt" || {
        echo "[torch-matrix] a pin in requirements.txt does not install on Python $PY (see pip's error above)" >&2
        exit 3; }
    "${pip[@]}" --no-deps -r requirements-voxcpm.txt
    "${pip[@]}" --no-deps -e . 2>"$VENV/editable.log" || { cat "$VENV/editable.log"; exit 1; }
    touch "$STAMP"
    set +e
fi

[ "$SUITE" = install ] && { echo "[torch-matrix] $VENV ready"; exit 0; }
LOG=$VENV/matrix-$(date +%Y%m%d-%H%M%S)
mkdir -p "$LOG"
tree() { echo "HEAD $(git -C "$ROOT" rev-parse --short HEAD) diff-sha $(git -C "$ROOT" diff HEAD | sha256sum | cut -c1-12)"; }
if [ -n "$REF" ]; then
    SRC=$(mktemp -d "${TMPDIR:-/tmp}/fastattn-$REF.XXXXXX")
    git archive "$REF" | tar -x -C "$SRC" && git -C "$SRC" init -q   # tests list files with git ls-files
    export PYTHONPATH=$SRC                                             # ahead of the editable install
    echo "[torch-matrix] testing $REF = $(git rev-parse --short "$REF") exported to $SRC" | tee "$LOG/tree.txt"
else
    SRC=$ROOT
    echo "[torch-matrix] testing the working tree; at start: $(tree)" | tee "$LOG/tree.txt"
    git status --short fastattn tests >> "$LOG/tree.txt"
fi
cd "$SRC"
"$VENV/bin/python" -c "import sys, torch, fastattn, voxcpm; print('[torch-matrix] python', sys.version.split()[0],
      '| torch', torch.__version__, '| cuda build', torch.version.cuda, '| fastattn from', fastattn.__file__)" \
    | tee "$LOG/versions.txt"
"$VENV/bin/python" -m pip freeze > "$LOG/freeze.txt"

if [ "$SUITE" = exactness ]; then   # the record goes to this checkout's data/results, whatever REF was tested
    "$VENV/bin/python" scripts/exactness_matrix.py --out "$ROOT/data/results/torch-matrix" 2>&1 \
        | tee "$LOG/exactness.log"
    exit "${PIPESTATUS[0]}"
fi
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
export FASTATTN_TORCH_MATRIX=$TORCH   # test_pins_are_what_is_installed: this torch, not the pin, on purpose
"$VENV/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider --junitxml="$LOG/junit.xml" tests \
    2>&1 | tee "$LOG/pytest.log"
tests_rc=${PIPESTATUS[0]}

OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-torch$TORCH-py$PY.XXXXXX")
"$VENV/bin/python" -m fastattn gpu-check --device cpu --quick --out "$OUT/kit" 2>&1 | tee "$LOG/gpu-check.log"
kit_rc=${PIPESTATUS[0]}
cp "$OUT/kit/summary.md" "$LOG/gpu-check-summary.md" 2>/dev/null

[ -n "$REF" ] || echo "[torch-matrix] working tree at end: $(tree)" | tee -a "$LOG/tree.txt"
echo "[torch-matrix] torch $TORCH, Python $PY: core tests exit $tests_rc, gpu-check exit $kit_rc"
echo "[torch-matrix] logs in $LOG, gpu-check records in $OUT/kit"
[ "$tests_rc" = 0 ] && [ "$kit_rc" = 0 ]
