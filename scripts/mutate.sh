#!/usr/bin/env bash
# mutate.sh: mutation testing. Applies each single-point mutant of
# tests/mutants/mutants.txt, one at a time, to a scratch copy of the tracked
# tree (never to this working tree), rebuilds it, runs the fast tests, and
# prints KILLED or SURVIVED per mutant, then the score: killed / non-equivalent
# mutants. Not part of the test command (minutes per dozen mutants); the
# ctest `mutants.list_applies` runs `--check` so that the list cannot rot.
#
# usage: scripts/mutate.sh [--check] [--only ID[,ID...]] [--keep]
#   --check   only validate the list: every snippet found exactly once in its
#             file, every replacement different; exit 1 on any problem.
#   --only    run only these mutants (ids as in the list).
#   --keep    keep the scratch tree (its path is printed).
#
# The fast tests of a mutant are the `unit` and `cli` ctest labels of an
# ASan+UBSan debug build (first failure stops the run); a mutant tagged
# `threads` that survives them also meets the `threads` label of a
# ThreadSanitizer build. A run longer than KVP_MUTANT_TIMEOUT seconds (300
# by default; the unmutated tests take under a minute) counts as killed: the
# mutant hung. A mutant whose tree does not build is reported as STILLBORN and
# fails the run: the list must hold real programs. Equivalent mutants (an
# `equivalent:` line with the reason) are run too, must survive, and are left
# out of the score. One build job and one test at a time: the machine is shared.
# Exit status: 0 when the score reaches 95%, 1 otherwise or on a list problem.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
list=tests/mutants/mutants.txt
timeout_s=${KVP_MUTANT_TIMEOUT:-300}
check_only=0
only=""
keep=0
while [ $# -gt 0 ]; do
    case $1 in
        --check) check_only=1 ;;
        --only) shift; only=${1:-} ;;
        --keep) keep=1 ;;
        *) echo "usage: scripts/mutate.sh [--check] [--only ID[,ID...]] [--keep]" >&2; exit 2 ;;
    esac
    shift
done

tool=scripts/mutants.py
if [ "$check_only" = 1 ]; then
    exec python3 "$tool" check "$list" "$root"
fi
python3 "$tool" check "$list" "$root" --quiet

scratch=$(mktemp -d "${TMPDIR:-/tmp}/kvp-mutate.XXXXXX")
cleanup() { [ "$keep" = 1 ] && echo "scratch tree kept: $scratch" || rm -rf "$scratch"; }
trap cleanup EXIT
tree=$scratch/tree
mkdir -p "$tree"
git ls-files -z | xargs -0 cp --parents -t "$tree"

ids=$(python3 "$tool" ids "$list" "$only")
need_tsan=$(python3 "$tool" has-threads "$list" "$only")

configure() { # configure DIR ARGS...
    local dir=$1
    shift
    cmake -S "$tree" -B "$dir" -G Ninja -DKVP_WERROR=OFF -DKVP_MEMCHECK=OFF \
        -DKVP_ABI_CHECK=OFF "$@" >"$scratch/configure.log" 2>&1 ||
        { cat "$scratch/configure.log"; exit 1; }
}
echo "mutate.sh: building the unmutated tree in $scratch"
configure "$scratch/debug" -DCMAKE_BUILD_TYPE=Debug -DKVP_SANITIZE=ON
cmake --build "$scratch/debug" -j 1 >"$scratch/build.log" 2>&1 || { cat "$scratch/build.log"; exit 1; }
if [ "$need_tsan" = 1 ]; then
    configure "$scratch/tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVP_SANITIZE=OFF -DKVP_TSAN=ON
    cmake --build "$scratch/tsan" -j 1 >"$scratch/build.log" 2>&1 ||
        { cat "$scratch/build.log"; exit 1; }
fi

# The unmutated tree must pass what the mutants are measured with.
fast_tests() { # fast_tests BUILD LABELS LOG: 0 when every test passed
    timeout "$timeout_s" ctest --test-dir "$1" -L "$2" -LE mutants -j 1 --stop-on-failure \
        --no-tests=error >"$3" 2>&1
}
fast_tests "$scratch/debug" 'unit|cli' "$scratch/baseline.log" ||
    { cat "$scratch/baseline.log"; echo "mutate.sh: the unmutated tree fails its tests" >&2; exit 1; }

# The first failed test's name, or "timeout".
culprit() { # culprit LOG STATUS
    if [ "$2" = 124 ]; then
        echo "timeout after ${timeout_s}s"
    else
        sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) .*\*\*\*.*/\1/p' "$1" | head -n 1
    fi
}

killed=0
survived=0
equivalent=0
problems=0
survivors=""
for id in $ids; do
    file=$(python3 "$tool" field "$list" "$id" file)
    tag=$(python3 "$tool" field "$list" "$id" tag)
    reason=$(python3 "$tool" field "$list" "$id" equivalent)
    cp "$tree/$file" "$scratch/original"
    python3 "$tool" apply "$list" "$id" "$tree"
    log=$scratch/$id.log
    verdict=SURVIVED
    by=""
    if ! cmake --build "$scratch/debug" -j 1 >"$log" 2>&1; then
        verdict=STILLBORN
    else
        status=0
        fast_tests "$scratch/debug" 'unit|cli' "$log" || status=$?
        if [ "$status" != 0 ]; then
            verdict=KILLED
            by=$(culprit "$log" "$status")
        elif [ "$tag" = threads ]; then
            if ! cmake --build "$scratch/tsan" -j 1 >"$log" 2>&1; then
                verdict=STILLBORN
            else
                fast_tests "$scratch/tsan" threads "$log" || status=$?
                if [ "$status" != 0 ]; then
                    verdict=KILLED
                    by="tsan $(culprit "$log" "$status")"
                fi
            fi
        fi
    fi
    cp "$scratch/original" "$tree/$file"
    if [ -n "$reason" ]; then
        if [ "$verdict" = SURVIVED ]; then
            equivalent=$((equivalent + 1))
            echo "EQUIVALENT $id ($file): $reason"
        else
            problems=$((problems + 1))
            echo "WRONG-EQUIVALENT $id ($file): marked equivalent but $verdict ${by:+by $by}"
        fi
        continue
    fi
    case $verdict in
        KILLED) killed=$((killed + 1)); echo "KILLED $id ($file) by ${by:-?}" ;;
        SURVIVED) survived=$((survived + 1)); survivors="$survivors $id"; echo "SURVIVED $id ($file)" ;;
        STILLBORN) problems=$((problems + 1)); echo "STILLBORN $id ($file): does not build"; tail -n 5 "$log" ;;
    esac
done
# Rebuild nothing of the restored tree: the scratch copy goes away.
scored=$((killed + survived))
echo
echo "mutants: $killed killed, $survived survived, $equivalent equivalent (not scored), $problems list problems"
if [ "$survived" -gt 0 ]; then
    echo "survivors:$survivors"
fi
if [ "$scored" -eq 0 ]; then
    echo "score: no scored mutant"
    exit 1
fi
percent=$(awk -v k="$killed" -v n="$scored" 'BEGIN { printf "%.1f", 100 * k / n }')
echo "score: $killed / $scored = $percent% of non-equivalent mutants killed (target 95%)"
[ "$problems" -eq 0 ] && awk -v k="$killed" -v n="$scored" 'BEGIN { exit !(k * 100 >= 95 * n) }'
