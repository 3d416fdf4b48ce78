#!/usr/bin/env bash
# scripts/prepare_corpus.sh runs tools from build/; run on its own (as test_tokenizer_reference.sh does
# when the corpus is missing, or by hand on a fresh clone), it must build each of them first, or it
# stops after the encoding with "build/...: No such file or directory". Checks that every build/ tool
# the script runs is a target of a make line that comes before it. Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
script=scripts/prepare_corpus.sh
fails=0
built=""
while IFS= read -r line; do
    case "$line" in
        *make\ *build/*) built="$built $(grep -oE 'build/[A-Za-z0-9_]+' <<<"$line" | tr '\n' ' ')" ;;
        build/*)
            tool=$(grep -oE '^build/[A-Za-z0-9_]+' <<<"$line")
            if [[ " $built " != *" $tool "* ]]; then
                echo "FAIL: $script runs $tool before any make line builds it (built:$built)"
                fails=1
            fi
            ;;
    esac
done < <(sed -E 's/^[[:space:]]+//' "$script")
ran=$(grep -cE '^[[:space:]]*build/' "$script")
[ "$ran" -ge 2 ] || { echo "FAIL: expected $script to run build/prepare_data and build/prepare_eval, found $ran"; fails=1; }
[ $fails = 0 ] && echo "ok: every build/ tool $script runs is built first"
exit $fails
