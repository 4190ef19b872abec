#!/bin/bash
# Redraw a committed CPU study report from the runs folder of its running grid, and copy the report's
# summary lines into the page that quotes them (between its study-summary markers; tests/test_study.py
# checks that they match report.json). Run from the repository root, then commit:
#   docs/results/refresh.sh claims [runs/study-claims-cpu]   -> docs/results/study-cpu, README.md
#   docs/results/refresh.sh looped [runs/study-looped-cpu]   -> docs/results/study-looped-cpu, docs/looped.md
# It trains nothing (--report-only). The runs folder is the grid's, e.g. for claims:
#   keel study claims --scale cpu --workers 2 --out runs/study-claims-cpu --resume --restore docs/results/study-cpu/report.json
set -euo pipefail
study=${1:?"usage: docs/results/refresh.sh claims|looped [RUNS_FOLDER]"}
case "$study" in
  claims) dest=docs/results/study-cpu; page=README.md ;;
  looped) dest=docs/results/study-looped-cpu; page=docs/looped.md ;;
  *) echo "refresh.sh: unknown study '$study' (claims or looped)" >&2; exit 2 ;;
esac
out=${2:-runs/study-$study-cpu}
mkdir -p "$dest"
restore=()
if [ -f "$dest/report.json" ]; then restore=(--restore "$dest/report.json"); fi
.venv/bin/keel study "$study" --scale cpu --out "$out" --report-only "${restore[@]}"
for f in report.json report.md "$out"/*.png; do
  if [ -e "$out/$(basename "$f")" ]; then cp "$out/$(basename "$f")" "$dest/"; fi
done
.venv/bin/python - "$dest/report.json" "$page" <<'PY'
import json, os, re, sys
lines = "\n".join("- " + s for s in json.load(open(sys.argv[1]))["summary"])
page = sys.argv[2]
text = open(page).read()
new, n = re.subn(r"(<!-- study-summary:start -->\n).*?(\n<!-- study-summary:end -->)",
                 lambda m: m.group(1) + lines + m.group(2), text, flags=re.S)
if n != 1:
    sys.exit(f"refresh.sh: {page} has no study-summary markers")
open(page + ".tmp", "w").write(new)
os.replace(page + ".tmp", page)
PY
grep -m1 "^Runs finished" "$dest/report.md"
