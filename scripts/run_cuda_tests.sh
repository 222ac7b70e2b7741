#!/usr/bin/env bash
# The CUDA tests split over several pytest processes on one machine (one GPU is enough).
#
#   bash scripts/run_cuda_tests.sh                      # every CUDA test of tests/, 12 processes
#   SHARDS=4 CAP=300 bash scripts/run_cuda_tests.sh tests/ops/test_decode_ops.py   # one file, or a folder: tests/ops
#   PART=1/2 SHARDS=16 CAP=500 bash scripts/run_cuda_tests.sh   # the first of two halves (then PART=2/2)
#
# In one process the CUDA suite takes well over 20 minutes on an H200, mostly Triton compiling the kernels of each
# test case on one CPU core; N processes spread those compiles over N cores. The test ids that `-m MARK` collects
# (MARK: `cuda` by default; empty for every test) are dealt round-robin to SHARDS processes, each run under
# `timeout CAP` (0: no cap), each writing LOGS/shard_I.log (LOGS: $OUT if set, else out/cuda_tests). Prints one
# summary line and the failures of each shard; exits 1 if any shard failed or was cut off by the cap, 2 if nothing
# was collected. PART=i/n keeps every n-th collected id from the i-th on (the same split on every machine): the whole
# CUDA suite takes longer than one 10-minute device call (1,202 tests: 16 processes were not through in 9 minutes on
# transformers 5.25), so it runs as n calls, PART=1/n .. n/n.
set -uo pipefail
cd "$(dirname "$0")/.."

SHARDS=${SHARDS:-12}
CAP=${CAP:-0}
MARK=${MARK-cuda}
LOGS=${LOGS:-${OUT:-out/cuda_tests}}
if ! [[ "$SHARDS" =~ ^[1-9][0-9]*$ ]]; then echo "SHARDS must be a positive integer, got '$SHARDS'" >&2; exit 2; fi
if ! [[ "$CAP" =~ ^[0-9]+$ ]]; then echo "CAP must be a number of seconds (0: no cap), got '$CAP'" >&2; exit 2; fi
PART=${PART:-1/1}
if ! [[ "$PART" =~ ^([1-9][0-9]*)/([1-9][0-9]*)$ ]] || [ "${BASH_REMATCH[1]}" -gt "${BASH_REMATCH[2]}" ]; then
  echo "PART must be i/n with 1 <= i <= n, got '$PART'" >&2; exit 2
fi
part_i=${BASH_REMATCH[1]}; part_n=${BASH_REMATCH[2]}
[ $# -gt 0 ] || set -- tests
mkdir -p "$LOGS"

PY=${PYTHON:-python}
mark_args=()
[ -n "$MARK" ] && mark_args=(-m "$MARK")
"$PY" -m pytest -q -p no:cacheprovider --rootdir . --collect-only "${mark_args[@]}" "$@" 2> "$LOGS/collect.err" \
  | grep -E '^[^ ]+::[^ ]' | awk '!seen[$0]++' | awk -v n="$part_n" -v i="$part_i" '(NR - 1) % n == i - 1' \
  > "$LOGS/ids.txt"
total=$(wc -l < "$LOGS/ids.txt")
echo "collected $total tests (-m '${MARK}', part $PART) from $*; $SHARDS processes, cap ${CAP}s; logs in $LOGS"
if [ "$total" -eq 0 ]; then echo "nothing collected; see $LOGS/collect.err" >&2; exit 2; fi

pids=()
for i in $(seq 0 $((SHARDS - 1))); do
  awk -v n="$SHARDS" -v i="$i" 'NR % n == i' "$LOGS/ids.txt" > "$LOGS/ids_$i.txt"
  [ -s "$LOGS/ids_$i.txt" ] || { pids+=(""); continue; }
  mapfile -t ids < "$LOGS/ids_$i.txt"
  if [ "$CAP" -gt 0 ]; then run=(timeout "$CAP"); else run=(); fi
  "${run[@]}" "$PY" -m pytest -q -p no:cacheprovider --rootdir . -rfE "${ids[@]}" > "$LOGS/shard_$i.log" 2>&1 &
  pids+=($!)
done

failed=0
for i in "${!pids[@]}"; do
  [ -n "${pids[$i]}" ] || continue
  wait "${pids[$i]}"; rc=$?
  case $rc in
    0) status="ok" ;;
    124) status="CUT OFF by the ${CAP}s cap"; failed=1 ;;
    *) status="FAILED (pytest exit $rc)"; failed=1 ;;
  esac
  echo "shard $i ($(wc -l < "$LOGS/ids_$i.txt") tests): $status: $(tail -n 1 "$LOGS/shard_$i.log")"
  grep -h '^FAILED\|^ERROR' "$LOGS/shard_$i.log"
done
exit $failed
