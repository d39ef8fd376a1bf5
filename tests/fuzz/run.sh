#!/usr/bin/env bash
# run.sh FUZZER CORPUS WORKDIR SECONDS [SEED]: fuzzes for SECONDS on one
# worker, from a fixed seed (default 1), starting from a scratch copy of
# CORPUS in WORKDIR/corpus, so the committed corpus is never modified. Crash
# inputs land in WORKDIR/crashes/; the exit status is the fuzzer's (nonzero
# on any crash, leak or shadow-model mismatch).
#
# At most 200000 executions as well, so that a fast machine does the same
# bounded work and stays far below the RSS limit (ASan's quarantine and the
# in-memory corpus grow with executions).
set -euo pipefail
fuzzer=$1
corpus=$2
workdir=$3
seconds=$4
seed=${5:-1}
rm -rf "$workdir/corpus"
mkdir -p "$workdir/corpus" "$workdir/crashes"
find "$corpus" -maxdepth 1 -type f ! -name 'README*' -exec cp {} "$workdir/corpus/" \;
status=0
"$fuzzer" -seed="$seed" -max_total_time="$seconds" -runs=200000 -max_len=1024 \
    -timeout=30 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$workdir/crashes/" "$workdir/corpus" || status=$?
if [ $status -ne 0 ]; then
    echo "run.sh: the fuzzer failed (exit $status); inputs in $workdir/crashes/:" >&2
    ls -l "$workdir/crashes/" >&2
fi
exit $status
