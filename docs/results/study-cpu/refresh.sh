#!/bin/bash
# Redraw the committed CPU study report from the runs folder of the running grid, and copy the
# report's summary lines into README.md (between the study-summary markers; tests/test_study.py
# checks that they match report.json). Run from the repository root, then commit:
#   docs/results/study-cpu/refresh.sh [runs/study-claims-cpu]
# It trains nothing (--report-only). The runs folder is the grid's: keel study claims --scale cpu
# --workers 2 --out runs/study-claims-cpu --resume --restore docs/results/study-cpu/report.json
set -euo pipefail
out=${1:-runs/study-claims-cpu}
dest=docs/results/study-cpu
.venv/bin/keel study claims --scale cpu --out "$out" --report-only --restore "$dest/report.json"
for f in report.json report.md "$out"/*.png; do cp "$out/$(basename "$f")" "$dest/"; done
.venv/bin/python - "$dest/report.json" <<'PY'
import json, os, re, sys
lines = "\n".join("- " + s for s in json.load(open(sys.argv[1]))["summary"])
text = open("README.md").read()
new, n = re.subn(r"(<!-- study-summary:start -->\n).*?(\n<!-- study-summary:end -->)",
                 lambda m: m.group(1) + lines + m.group(2), text, flags=re.S)
if n != 1:
    sys.exit("refresh.sh: README.md has no study-summary markers")
open("README.md.tmp", "w").write(new)
os.replace("README.md.tmp", "README.md")
PY
grep -m1 "^Runs finished" "$dest/report.md"
