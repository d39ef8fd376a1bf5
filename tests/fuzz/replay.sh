#!/usr/bin/env bash
# replay.sh FUZZER DIR...: runs the fuzz target once on every file of each DIR
# (the committed regression cases and the seed corpus). Fails if any input
# crashes or makes the target report a mismatch. Files named README* are
# documentation, not inputs.
set -euo pipefail
fuzzer=$1
shift
inputs=()
for dir in "$@"; do
    while IFS= read -r -d '' file; do
        inputs+=("$file")
    done < <(find "$dir" -maxdepth 1 -type f ! -name 'README*' -print0 | sort -z)
done
if [ ${#inputs[@]} -eq 0 ]; then
    echo "replay.sh: no inputs in $*" >&2
    exit 1
fi
echo "replaying ${#inputs[@]} inputs"
exec "$fuzzer" -runs=1 "${inputs[@]}"
