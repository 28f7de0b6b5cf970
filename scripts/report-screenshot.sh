#!/usr/bin/env bash
# README's picture of a landing page (data/results/report-index.png), from the committed reference run's index.html.
# Needs Chromium (Debian: apt-get install chromium); make docs does not run it (no browser in make test).
set -euo pipefail
cd "$(dirname "$0")/.."
reference="$(.venv/bin/python -c 'from tools.readme import REFERENCE; print(REFERENCE)')"  # the reference run's folder
page="data/results/$reference/index.html"
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$profile" --hide-scrollbars --window-size=1200,1500 \
  --screenshot="$PWD/data/results/report-index.png" "file://$PWD/$page"
