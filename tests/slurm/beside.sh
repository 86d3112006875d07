#!/usr/bin/env bash
# make test-all: the real Slurm cluster's tests, one at a time as always, beside the slow tests; then what the
# Slurm tests printed, and the status of both. The two suites share no file, port or job id, and one of them
# waits much of its time: on 2 cores the Slurm tests kept the CPUs busy 60 % of their 300 s, the slow tests 88 %
# of their 2,000 s; one after the other they took the sum.
#   tests/slurm/beside.sh PYTHON [the slow tests' pytest options...]
set -uo pipefail
python=$1
shift
log=$(mktemp)
"$python" -m pytest -m slurm -p no:cacheprovider >"$log" 2>&1 &
slurm=$!
trap 'kill "$slurm" 2>/dev/null; rm -f "$log"' EXIT # an interrupted make stops both
"$python" -m pytest -m "slow and not slurm" "$@"
slow=$?
wait "$slurm"
status=$?
trap 'rm -f "$log"' EXIT # ended: its pid may be another process's now
echo "== the Slurm tests, run beside the slow ones (exit status $status)"
cat "$log"
exit $((slow != 0 || status != 0))
