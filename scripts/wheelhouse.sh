#!/usr/bin/env bash
# Offline wheelhouse for a GPU box that already has torch:   scripts/wheelhouse.sh [PY]   (default 3.12)
# REF=<commit> builds the fastattn wheel from that commit instead of the working tree.
# Writes wheelhouse-py<PY>/: wheels for that Python (manylinux_2_28 or older, x86_64) of voxcpm (no deps),
# fastattn (built from this tree) and everything the kit and the notebooks need that the box's image lacks,
# at requirements.txt's pins; never torch, triton, nvidia-* or cuda-*. Also requirements.txt (resolved
# install), requirements-nodeps.txt (installed with --no-deps), gpu-box.sh (install + gpu-check), MANIFEST.txt,
# and fastattn-root/ (the same tree's data/ and notebooks/, which the wheel does not carry).
#
# librosa: `import voxcpm` imports it, but only reference-audio prompts (librosa.load/effects.trim) call it,
# and those need llvmlite + numba (57 + 4 MiB of wheels), scikit-learn (9 MiB) and more. By default librosa
# is installed with --no-deps plus lazy_loader, which is all `import librosa` needs (27 MiB in all).
# FULL_LIBROSA=1 MAX_MIB=110 adds librosa's runtime closure (+72 MiB: about 100 MiB in all).
# OUT=<folder> writes elsewhere than wheelhouse-py<PY>/.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${1:-3.12}
OUT=${OUT:-wheelhouse-py$PY}
MAX_MIB=${MAX_MIB:-60}
# What the GPU image already has; the wheelhouse never enters these or their requirements.
IMAGE=${IMAGE:-"torch triton torchaudio numpy scipy matplotlib transformers tokenizers huggingface_hub einops safetensors
tqdm pytest hypothesis"}
IMAGE=$(echo $IMAGE)  # one line
# The packages in requirements.txt the kit and notebooks need beside the image (jupyterlab and ruff are
# desk tools, not needed on the box). TOP are installed at their pins; pyyaml's wheel is there in case
# the box lacks it (its transformers requires it), never to replace the box's own.
TOP="pydantic papermill nbconvert ipykernel ipywidgets"
ROOTS="$TOP pyyaml"
export PIP_CONSTRAINT=
TARGET=(--only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux_2_28_x86_64 --platform any)

pin() { grep -iE "^$1==" requirements.txt; }
# shellcheck source=wheelhouse-pins.sh
. scripts/wheelhouse-pins.sh
PYBIN=$(scripts/find-python.sh "$PY")   # markers (python_version) are evaluated by the resolving interpreter
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

rm -rf "$OUT"; mkdir -p "$OUT"
echo "[wheelhouse] building the fastattn wheel from ${REF:-the working tree}"
mkdir "$WORK/src"   # a clean copy: an in-tree build/ can carry modules deleted since into the wheel
if [ -n "${REF:-}" ]; then git archive "$REF" | tar -xf - -C "$WORK/src"; else
    git ls-files -co --exclude-standard -z | tar --null -T - --ignore-failed-read -cf - 2>/dev/null \
        | tar -xf - -C "$WORK/src"; fi
"$PYBIN" -m pip wheel --quiet --no-deps --wheel-dir "$OUT" "$WORK/src" 2>"$WORK/build.log" \
    || { cat "$WORK/build.log"; exit 1; }
FASTATTN=$(basename "$OUT"/fastattn-*.whl | cut -d- -f2)

# One resolve of the roots together with the image's packages at the box's own versions (wheelhouse-pins.sh,
# else requirements.txt's pins), so that shared requirements get versions that agree with the box.
for p in $ROOTS librosa; do pin "$p" || { echo "$p is not pinned in requirements.txt" >&2; exit 2; }; done \
    > "$WORK/resolve.txt"
for p in $IMAGE; do case $p in torch|triton|torchaudio) ;; *) box_pin "$p" || echo "$p";; esac; done >> "$WORK/resolve.txt"
echo "[wheelhouse] resolving for Python $PY"
"$PYBIN" -m pip install --quiet --dry-run --ignore-installed --target "$WORK/t" "${TARGET[@]}" \
    --report "$WORK/report.json" -r "$WORK/resolve.txt" 2> >(grep -v "is ignored" >&2)

if [ "${FULL_LIBROSA:-0}" = 1 ]; then top="$TOP librosa"; nodeps=""; else top="$TOP lazy-loader"; nodeps=librosa; fi
"$PYBIN" scripts/wheelhouse_plan.py "$WORK/report.json" --python "$PY" --roots "$top pyyaml" --nodeps "$nodeps" \
    --image "$IMAGE" > "$WORK/wheels.txt"
if grep -iE '^(torch|triton|nvidia-|cuda-)' "$WORK/wheels.txt"; then echo "torch/CUDA packages in the plan" >&2; exit 1; fi

echo "[wheelhouse] downloading $(wc -l < "$WORK/wheels.txt") wheels + voxcpm"
"$PYBIN" -m pip download --quiet --no-deps --dest "$OUT" "${TARGET[@]}" -r "$WORK/wheels.txt" \
    -r requirements-voxcpm.txt 2> >(grep -v "is ignored" >&2)

# A pip wheel (this builder's version), for gpu-box.sh on an image whose Python has no pip: it runs from the file.
"$PYBIN" -m pip download --quiet --no-deps --dest "$OUT" "${TARGET[@]}" "pip==$("$PYBIN" -m pip --version | cut -d' ' -f2)"

# The box installs the resolved list first, then the --no-deps list (voxcpm's own requirements pull a web UI
# and a CUDA torchaudio; librosa's pull numba/llvmlite; fastattn's are all satisfied by then).
{ echo "# pip install --no-index --find-links <this folder> -r requirements.txt"
  for p in $top; do grep -iE "^${p//-/[-_]}==" "$WORK/wheels.txt"; done; } > "$OUT/requirements.txt"
{ echo "# pip install --no-index --find-links <this folder> --no-deps -r requirements-nodeps.txt"
  cat requirements-voxcpm.txt | grep -E '^[a-zA-Z]'
  for p in $nodeps; do grep -iE "^$p==" "$WORK/wheels.txt"; done
  echo "fastattn==$FASTATTN"; } > "$OUT/requirements-nodeps.txt"
cp scripts/gpu-box.sh "$OUT/gpu-box.sh"
# fastattn reads data/ (the architecture, reference records) and notebooks/ from its checkout, which a wheel
# does not carry: the same tree's copies, for gpu-box.sh to point FASTATTN_ROOT at where no checkout is found.
mkdir "$OUT/fastattn-root" && cp -r "$WORK/src/data" "$WORK/src/notebooks" "$OUT/fastattn-root/"

bytes=$(du -cb "$OUT" | tail -1 | cut -f1)
if [ -n "${REF:-}" ]; then from="$REF = $(git rev-parse --short "$REF")"; else
    from="the working tree at $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- fastattn pyproject.toml \
        || echo ' with uncommitted changes in fastattn/ or pyproject.toml')"; fi
{ echo "wheelhouse for Python $PY, built $(date -u +%Y-%m-%dT%H:%MZ), fastattn from $from"
  echo "image assumed to have: $IMAGE"
  echo "librosa: $([ -n "$nodeps" ] && echo 'import-time only (--no-deps; no numba/llvmlite)' || echo 'full')"
  echo "total: $bytes bytes ($((bytes / 1048576)) MiB), $(ls "$OUT"/*.whl | wc -l) wheels;" \
       "fastattn-root/ (data/, notebooks/): $(du -sk "$OUT/fastattn-root" | cut -f1) KiB"
  echo; (cd "$OUT" && ls -l --block-size=K *.whl | awk '{print $5, $9}' | sort -k2)
} > "$OUT/MANIFEST.txt"
head -4 "$OUT/MANIFEST.txt"
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then echo "[wheelhouse] over MAX_MIB=$MAX_MIB MiB" >&2; exit 1; fi
