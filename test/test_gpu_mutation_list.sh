#!/usr/bin/env bash
# dev/gpu_mutations.txt keeps up with the code: every mutation's text is in its file as the list says
# (dev/gpu_mutation_runs.sh --verify, no GPU or build needed), so that a GPU mutation pass never finds a
# mutant it cannot make; and --verify reports a text that is not there.
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/gpu_mutation_runs.sh --verify >/tmp/gpu_mutation_list.$$ 2>&1 || {
    grep -v "^ok" /tmp/gpu_mutation_list.$$; rm -f /tmp/gpu_mutation_list.$$; echo "FAIL: dev/gpu_mutations.txt"; exit 1; }
tail -n 1 /tmp/gpu_mutation_list.$$
rm -f /tmp/gpu_mutation_list.$$
# A list whose text is not in the code must fail --verify, naming the mutation.
dir=$(mktemp -d /tmp/gpu_mutation_list_XXXXXX)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/dev" "$dir/llmc"
cp dev/gpu_mutation_runs.sh "$dir/dev/"
printf 'int f() { return 1; }\nint g() { return 1; }\n' >"$dir/llmc/x.cuh"
printf '%s\n' 'gone ||| llmc/x.cuh ||| return 2; ||| return 3; ||| a text that is not there' \
    'twice ||| llmc/x.cuh ||| return 1; ||| return 0; ||| a text that is there twice, without @N' \
    'second ||| llmc/x.cuh@2 ||| return 1; ||| return 0; ||| the second of two' >"$dir/dev/gpu_mutations.txt"
if bash "$dir/dev/gpu_mutation_runs.sh" --verify >"$dir/out" 2>&1; then
    echo "FAIL: --verify passed a list with texts not in the code"; cat "$dir/out"; exit 1
fi
grep -q "^BAD  gone: " "$dir/out" && grep -q "^BAD  twice: " "$dir/out" && grep -q "^ok   second " "$dir/out" &&
    grep -q "3 mutations, 2 whose text" "$dir/out" || { echo "FAIL: --verify's report"; cat "$dir/out"; exit 1; }
echo "ok"
