#!/usr/bin/env bash
# Test what users install: build gradwire's wheel, install it (not editable) into a fresh venv that
# reuses this Python's torch and other packages, and run a 2-rank smoke experiment from an empty
# folder that is not the checkout. Fails if the wheel ships anything but `gradwire` at top level
# or any path naming the CUDA emulator (a test tool: tools/cuda_emulator),
# if the venv imports gradwire from anywhere but its own site-packages, or if the report, plot or
# CSV is missing where the relative --out points.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# build from a copy of the files git knows (no stale build/ folder, nothing written into the checkout)
mkdir "$work/src"
(cd "$repo" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$work/src"
"$PY" -m pip wheel -q --no-deps --no-build-isolation "$work/src" -w "$work/dist"
wheel=$(ls "$work"/dist/gradwire-*.whl)
tops=$("$PY" -c 'import sys, zipfile; print(" ".join(sorted({n.split("/")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()})))' "$wheel")
case "$tops" in
  "gradwire gradwire-"*".dist-info") ;;
  *) echo "check-wheel: the wheel installs more than gradwire at top level: $tops" >&2; exit 1 ;;
esac
emulator=$("$PY" -c 'import sys, zipfile; print(" ".join(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if "emulator" in n))' "$wheel")
if [ -n "$emulator" ]; then
  echo "check-wheel: the wheel ships the CUDA emulator, a test tool (tools/cuda_emulator): $emulator" >&2; exit 1
fi

"$PY" -m venv --system-site-packages "$work/venv"
venv_py="$work/venv/bin/python"
"$venv_py" -m pip install -q --no-deps --ignore-installed "$wheel"
mkdir "$work/user" && cd "$work/user"   # an empty folder, not the checkout
where=$("$venv_py" -c 'import gradwire; print(gradwire.__file__)')
case "$where" in
  "$work/venv/"*) ;;
  *) echo "check-wheel: the venv imported gradwire from $where, not from the installed wheel" >&2; exit 1 ;;
esac
"$work/venv/bin/gradwire" list >/dev/null
# the framework adapters ship in the wheel and import from it (CI installs every framework)
"$venv_py" -c 'import gradwire.integrations.lightning, gradwire.integrations.accelerate, gradwire.integrations.hf_trainer, gradwire.integrations.torchtitan as t; assert "/venv/" in t.__file__, t.__file__'
"$work/venv/bin/gradwire" experiment --methods none,topk --ratios 0.01 --worlds 2 --steps 20 --eval-every 10 \
  --no-progress --out smoke/out
for f in report.md runs.csv steps.csv accuracy_vs_bytes.png accuracy_vs_time.png; do
  [ -s "smoke/out/$f" ] || { echo "check-wheel: smoke/out/$f is missing or empty" >&2; exit 1; }
done
grep -q "topk:ratio=0.01" smoke/out/runs.csv || { echo "check-wheel: runs.csv has no top-k run" >&2; exit 1; }
echo "check-wheel: $(basename "$wheel") installed in a venv; 2-rank smoke experiment from $work/user: ok"
