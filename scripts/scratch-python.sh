#!/usr/bin/env bash
# A scratch system Python, standing in for a GPU image's interpreter:   scripts/scratch-python.sh PYTHON DEST [managed]
# [nopip]. PYTHON's base interpreter (a venv's too) is copied to DEST/bin (a copy, not a link, so that DEST is its
# prefix), its stdlib linked in, with an empty site-packages of its own. `managed` plants PEP 668's
# EXTERNALLY-MANAGED marker, as Ubuntu 24.04's python3 has it (pip then refuses to install outside a venv);
# the base's pip is linked into site-packages unless `nopip`. Prints DEST's interpreter.
set -euo pipefail
PYTHON=${1:?usage: scripts/scratch-python.sh PYTHON DEST [managed] [nopip]}
DEST=${2:?usage: scripts/scratch-python.sh PYTHON DEST [managed] [nopip]}
shift 2
read -r BASE VER PIP < <("$PYTHON" -c 'import sys, pathlib, pip
print(sys.base_prefix, "python%d.%d" % sys.version_info[:2], pathlib.Path(pip.__file__).parent)')
[ -x "$BASE/bin/$VER" ] && [ -f "$BASE/lib/$VER/os.py" ] || { echo "$BASE is not a bin/ + lib/$VER layout" >&2; exit 2; }
[ ! -e "$DEST" ] || { echo "$DEST exists" >&2; exit 2; }
mkdir -p "$DEST/bin" "$DEST/lib/$VER/site-packages"
cp "$BASE/bin/$VER" "$DEST/bin/$VER"
for entry in "$BASE/lib/$VER"/*; do
    [ "$(basename "$entry")" = site-packages ] || ln -s "$entry" "$DEST/lib/$VER/"
done
managed=0 pip=1
for opt in "$@"; do case $opt in managed) managed=1;; nopip) pip=0;; *) echo "unknown option $opt" >&2; exit 2;; esac; done
[ $pip = 0 ] || ln -s "$PIP" "$DEST/lib/$VER/site-packages/pip"
[ $managed = 0 ] || printf '[externally-managed]\nError=a scratch system Python (scripts/scratch-python.sh)\n' \
    > "$DEST/lib/$VER/EXTERNALLY-MANAGED"
echo "$DEST/bin/$VER"
