#!/usr/bin/env bash
# Run the Durable Streams conformance suite (@durable-streams/server-conformance-tests)
# against a server.
#
#   run-conformance.sh BASE_URL [OUT_JSON]
#
# BASE_URL: the suite appends "/v1/stream/<name>" to it (e.g. http://127.0.0.1:4437).
# OUT_JSON: where to write the vitest JSON report (default: logs/last-run.json here).
# Last line printed:  conformance: N passed, M failed, K skipped
# Exit: 0 if the suite ran (whatever the failures, unless CONFORMANCE_STRICT=1, then
#       1 on any failure); 2 server unreachable / bad args; 3 suite did not run/complete.
#
# Env knobs:
#   CONFORMANCE_TEST_TIMEOUT_MS  per-test timeout (default 30000, as upstream's vitest config)
#   CONFORMANCE_LONG_POLL_MS     suite option longPollTimeoutMs (long-poll tests get value+1000ms;
#                                suite default 20000)
#   CONFORMANCE_SUBSCRIPTIONS=1  also run the opt-in "Reserved subscription APIs" group (6 tests).
#                                Its test "rejects unsafe webhook URLs" registers http://10.0.0.1/hook;
#                                a server that does not reject it syntactically would send traffic to a
#                                private address, so that test is excluded (counted as skipped) unless
#                                CONFORMANCE_UNSAFE_WEBHOOK_TEST=1.
#   CONFORMANCE_FILTER=regex     only tests whose name matches (vitest -t); others count as skipped
#   CONFORMANCE_GROUPS=1         print a per-describe-group table
#   CONFORMANCE_VERBOSE=1        stream vitest's own output too
#   CONFORMANCE_TIMEOUT_S        wall-clock cap for the whole run (default 1200)
#   CONFORMANCE_STRICT=1         exit 1 if any test failed
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ] || [ -z "${1:-}" ]; then
  sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2
fi
BASE_URL="${1%/}"                       # the suite does "${base}/v1/stream/..."
OUT_JSON="${2:-$HERE/logs/last-run.json}"
case "$OUT_JSON" in /*) ;; *) OUT_JSON="$PWD/$OUT_JSON" ;; esac
mkdir -p "$(dirname "$OUT_JSON")" "$HERE/logs"
LOG="${OUT_JSON%.json}.log"
rm -f "$OUT_JSON"

cd "$HERE"
if [ ! -x node_modules/.bin/vitest ] || [ ! -d node_modules/@durable-streams/server-conformance-tests ]; then
  echo "installing npm deps in $HERE ..." >&2
  npm install --no-audit --no-fund >&2 \
    || { echo "npm install failed" >&2; exit 3; }
fi

# Reachability: any HTTP status is fine, a connection failure is not.
# (curl if present, else python3: CI images may lack curl.)
probe="$BASE_URL/v1/stream/__conformance_probe_$$"
if command -v curl >/dev/null 2>&1; then
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$probe" || true)
else
  code=$(python3 -c '
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=5).status)
except urllib.error.HTTPError as e:
    print(e.code)
except Exception:
    print("000")' "$probe" || true)
fi
if [ -z "$code" ] || [ "$code" = "000" ]; then
  echo "conformance: server not reachable at $BASE_URL" >&2; exit 2
fi

args=(run --config "$HERE/vitest.config.mjs" --reporter=json "--outputFile.json=$OUT_JSON")
[ "${CONFORMANCE_VERBOSE:-0}" = 1 ] && args+=(--reporter=default)
pattern=""
[ -n "${CONFORMANCE_FILTER:-}" ] && pattern="(?=.*(?:${CONFORMANCE_FILTER}))"
if [ "${CONFORMANCE_SUBSCRIPTIONS:-0}" = 1 ] && [ "${CONFORMANCE_UNSAFE_WEBHOOK_TEST:-0}" != 1 ]; then
  pattern="${pattern}(?!.*rejects unsafe webhook URLs)"
fi
[ -n "$pattern" ] && args+=(-t "^${pattern}.*$")

echo "running conformance suite against $BASE_URL (log: $LOG, json: $OUT_JSON)" >&2
start=$(date +%s)
if [ "${CONFORMANCE_VERBOSE:-0}" = 1 ]; then
  CONFORMANCE_TEST_URL="$BASE_URL" NO_COLOR=1 timeout "${CONFORMANCE_TIMEOUT_S:-1200}" \
    node_modules/.bin/vitest "${args[@]}" 2>&1 | tee "$LOG"; rc=${PIPESTATUS[0]}
else
  CONFORMANCE_TEST_URL="$BASE_URL" NO_COLOR=1 timeout "${CONFORMANCE_TIMEOUT_S:-1200}" \
    node_modules/.bin/vitest "${args[@]}" >"$LOG" 2>&1; rc=$?
fi
echo "vitest exit code $rc, wall time $(( $(date +%s) - start ))s" >&2
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  echo "conformance: run exceeded ${CONFORMANCE_TIMEOUT_S:-1200}s and was killed (see $LOG)" >&2; exit 3
fi
if [ ! -s "$OUT_JSON" ]; then
  echo "conformance: vitest produced no JSON report (see $LOG)" >&2; tail -20 "$LOG" >&2; exit 3
fi
sum_args=("$OUT_JSON"); [ "${CONFORMANCE_GROUPS:-0}" = 1 ] && sum_args+=(--groups)
summary=$(python3 "$HERE/summarize.py" "${sum_args[@]}"); src=$?
printf '%s\n' "$summary"
[ "$src" != 0 ] && exit 3
if [ "${CONFORMANCE_STRICT:-0}" = 1 ] && ! printf '%s\n' "$summary" | tail -1 | grep -q ' 0 failed,'; then exit 1; fi
exit 0
