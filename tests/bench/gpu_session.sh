#!/usr/bin/env bash
# One gpu_check command on a lent GPU machine (the device tool), its results gathered into $OUT, which
# brings back at most 8 files:
#   bash tests/bench/gpu_session.sh a,c,d      # the first command (carry .whl: tests/bench/gpu_wheels.sh)
#   bash tests/bench/gpu_session.sh b,e        # the second
#   bash tests/bench/gpu_session.sh d --cpu    # more arguments go to gpu_check.py (--cpu: tests this script)
# Installs the carried wheels (.whl/, if any) without the index, runs tests/bench/gpu_check.py into a
# scratch folder, and copies into $OUT (default runs/gc) its table, its JSON, the console log and the
# train.py runs' logs as one archive. Exits with gpu_check's code. GPU_CHECK_LIMIT (540 s): gpu_check's time.
set -uo pipefail
cd "$(dirname "$0")/../.."
sections=${1:?usage: gpu_session.sh SECTIONS (a,c,d or b,e) [gpu_check.py arguments]}
shift
out=${OUT:-runs/gc}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
scratch=$(mktemp -d /tmp/gpu_check_XXXX)
tag=${sections//,/}
# a time limit below the device's 600 s per command: on timeout's SIGTERM gpu_check stops its train.py runs
# and still writes the table and JSON of what ran. The device kills the whole command (SIGKILL, no
# handler runs) at its own limit, min(timeout_s, the session's device time left): set GPU_CHECK_LIMIT
# at least 40 s below that when less than 580 s are left. gpu_check writes its table and JSON into $OUT
# after every section, so even such a kill keeps the sections that had finished.
PYTHONUNBUFFERED=1 timeout -k 30 "${GPU_CHECK_LIMIT:-540}" \
    python3 tests/bench/gpu_check.py --only="$sections" --out="$scratch" --report-dir="$out" "$@" 2>&1 | tee "$out/console_$tag.log"
rc=${PIPESTATUS[0]}
tar -czf "$out/logs_$tag.tgz" -C "$scratch" logs 2>/dev/null
exit "$rc"
