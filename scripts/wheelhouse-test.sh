#!/usr/bin/env bash
# Rehearse the GPU box's offline install here:   scripts/wheelhouse-test.sh [PY [TORCH]]   (3.12, 2.11.0)
# A fresh venv stands in for the box's image: torch==TORCH and the image's other packages (IMAGE) at the box's own
# versions (scripts/wheelhouse-pins.sh, else requirements.txt's pins), from the index, minus pydantic, which the
# image lacks although transformers' CLI pulls it here. Then, with the index switched off,
# wheelhouse-py<PY>/gpu-box.sh installs the kit and runs `gpu-check --device cpu --quick`. Checks that torch is
# untouched and that no package the image had changed version. First, a strict resolve: the wheelhouse must
# complete the image's named packages alone (installed without their requirements), so a fuller stand-in here
# hides no missing wheel. The image is .venv-wheelhouse-test-py<PY>, a scratch system Python with PEP 668's marker
# (recreated each run); the kit's venv beside it, -kit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-3.12}
TORCH=${2:-2.11.0}
WH=$PWD/wheelhouse-py$PY
VENV=$PWD/.venv-wheelhouse-test-py$PY
IMAGE=${IMAGE:-"torchaudio numpy scipy matplotlib transformers tokenizers huggingface_hub einops safetensors tqdm pytest
hypothesis"}
IMAGE=$(echo $IMAGE)  # one line
LACKS="pydantic pydantic-core voxcpm librosa papermill nbconvert ipykernel ipywidgets"
export PIP_CONSTRAINT=
[ -f "$WH/gpu-box.sh" ] || { echo "no $WH: run make wheelhouse PY=$PY" >&2; exit 2; }

rm -rf "$VENV" "$VENV-kit"
# The image's interpreter is a system Python, not a venv: a scratch one (scripts/scratch-python.sh) gets the image's
# packages, then PEP 668's marker, as Ubuntu 24.04's python3 has it; gpu-box.sh must put the kit in a venv of its own.
BOXPY=$(scripts/scratch-python.sh "$(scripts/find-python.sh "$PY")" "$VENV")
pip=("$BOXPY" -m pip)
"${pip[@]}" install --quiet "torch==$TORCH"
# shellcheck source=wheelhouse-pins.sh
. scripts/wheelhouse-pins.sh
image=$(for p in $IMAGE; do box_pin "$p" || echo "$p"; done)
# Strict: with the image's named packages alone (none of what they require), the wheelhouse must still
# resolve the kit. Catches a wheel missing here that this machine's fuller stand-in would hide.
# shellcheck disable=SC2086
"${pip[@]}" install --quiet --no-deps $image
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "${pip[@]}" install --quiet --dry-run --no-index \
    --find-links "$WH" -r "$WH/requirements.txt"
echo "[wheelhouse-test] strict resolve against the named image packages only: ok"
# shellcheck disable=SC2086
"${pip[@]}" install --quiet -c <(echo "torch==$TORCH") $image
# shellcheck disable=SC2086
"${pip[@]}" uninstall --quiet -y $LACKS 2>/dev/null || true
"${pip[@]}" freeze | sort > "$VENV/freeze-image.txt"
printf '[externally-managed]\nError=the rehearsal of a PEP 668 system Python\n' > "$VENV/lib/python$PY/EXTERNALLY-MANAGED"
echo "[wheelhouse-test] image stand-in: $(wc -l < "$VENV/freeze-image.txt") packages, $(grep -i '^torch==' "$VENV/freeze-image.txt")"

OUT=$(mktemp -d "${TMPDIR:-/tmp}/wheelhouse-test.XXXXXX")
rc=0
# No index, no pip configuration (this machine's find-links and extra indexes), no hub: as on the box.
# From a folder outside the checkout, so that `python -m fastattn` imports the wheel, not ./fastattn.
(cd "$OUT" && env -u PIP_FIND_LINKS PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null HF_HUB_OFFLINE=1 \
    PYTHON="$BOXPY" GPU_BOX_VENV="$VENV-kit" bash "$WH/gpu-box.sh" --device cpu --quick --out "$OUT/kit") || rc=$?
"${pip[@]}" freeze | sort > "$VENV/freeze-after.txt"
echo "[wheelhouse-test] changed or removed by the install (must be empty):"
comm -23 "$VENV/freeze-image.txt" "$VENV/freeze-after.txt" | tee "$VENV/changed.txt"
echo "[wheelhouse-test] added to the image's Python (must be none: the kit is in $VENV-kit):"
comm -13 "$VENV/freeze-image.txt" "$VENV/freeze-after.txt" | tee -a "$VENV/changed.txt"
[ -s "$VENV/changed.txt" ] && rc=1
echo "[wheelhouse-test] gpu-box.sh exit $rc; records in $OUT/kit"
exit $rc
