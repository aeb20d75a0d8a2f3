#!/usr/bin/env bash
# The GPU run book as one device call: unpack the packages the device image lacks, check that every peer imports,
# run benchmarks/gpu_suite.py within a budget, and leave its results in $OUT (at most 8 files come back).
#
#   here:   python tools/device_bundle.py --data ../shared/data/mnist     # once: .devicepkgs/ (about 50 MiB)
#   device: run(command="BUDGET=500 bash tools/device_run.sh --only env,vs-flower", timeout_s=570,
#               carry=[".devicepkgs", "runs/gpu-suite"])      # the first call's pieces: docs/design.md
#   here:   mkdir -p runs && tar xzf <files_at>/gpu-suite.tgz -C runs   # (as gpu-suite/) to resume in a later call
#   a call that runs no peer (reproduce-*, runs-per-gpu, ...) carries the core alone and more data:
#   here:   python tools/device_bundle.py --extras "" --data ../shared/data/mnist --data ../shared/data/fashion-mnist \
#               --data ../shared/data/usps --out .devicepkgs-core      # then PKGS=.devicepkgs-core, carry it
#
# Arguments go to gpu_suite.py (--only, --papers, --seeds, ...). BUDGET (seconds, default 480) bounds the suite;
# the results accumulate in RESULTS (default runs/gpu-suite, carried back in, so a later call continues where this
# one stopped). PKGS (.devicepkgs), SITE (/tmp/fedskew-site), DATA_DIR ($PKGS/data) and PYTHON (python3) may be set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/fedskew-device-out}
PKGS=${PKGS:-.devicepkgs}
SITE=${SITE:-/tmp/fedskew-site}
RES=${RESULTS:-runs/gpu-suite}
mkdir -p "$OUTDIR" "$RES"
PY=${PYTHON:-python3}
if [ -f "$PKGS/site.tar.xz" ] && [ ! -f "$SITE/.unpacked" ]; then  # unpacked once per machine (kept while warm)
  mkdir -p "$SITE" && "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
    "$PKGS/site.tar.xz" "$SITE" && touch "$SITE/.unpacked" \
    || { echo "device_run: could not unpack $PKGS/site.tar.xz into $SITE" >&2; exit 2; }
fi
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# every package the run book imports, with its version or the reason it does not import (the suite then reports
# the pieces that need it as not run)
"$PY" - <<'PYEOF' 2>&1 | tee "$OUTDIR/imports.txt"
import importlib
for name in ("torch", "fedskew", "pydantic", "flwr", "ray", "pfl"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 - reported, the suite goes on
        print(f"{name} does not import: {type(e).__name__}: {e}")
PYEOF
DATA=${DATA_DIR:-$PKGS/data}
"$PY" benchmarks/gpu_suite.py --data-dir "$DATA" --out "$RES" --budget "${BUDGET:-480}" "$@" 2>&1 | tee "$OUTDIR/log.txt"
rc=${PIPESTATUS[0]}
[ -f "$RES/suite.md" ] && cp "$RES/suite.md" "$OUTDIR/suite.md"
PARENT=$(dirname "$RES") NAME=$(basename "$RES")
tar czf "$OUTDIR/gpu-suite.tgz" -C "$PARENT" "$NAME"
if [ "$(stat -c %s "$OUTDIR/gpu-suite.tgz")" -gt 15000000 ]; then  # over what comes back: the figures alone
  tar czf "$OUTDIR/gpu-suite.tgz" -C "$PARENT" --exclude="$NAME/runs" --exclude="$NAME/reproduce" "$NAME"
  echo "device_run: the run folders were left out of gpu-suite.tgz (over 15 MB)" | tee -a "$OUTDIR/log.txt"
fi
exit "$rc"
