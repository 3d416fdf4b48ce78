#!/usr/bin/env bash
# dev/gpu_mutations.txt keeps up with the code: every mutation's text is in its file as the list says
# (dev/gpu_mutation_runs.sh --verify, no GPU or build needed), so that a GPU mutation pass never finds a
# mutant it cannot make; and --verify reports a text that is not there. And a pass on a tree whose test
# program came without its dependency file (copied in: make would call it up to date after any header's
# edit, and the mutants would go untested) rebuilds that program first and says so (--check, on a tree
# with a stand-in Makefile, no compiler needed).
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

# A copied-in build/test_fp8 without build/test_fp8.d: removed and rebuilt (with its .d) before the pass,
# so that the mutant's edit of the header it includes reaches it.
printf '%s\n' 'second ||| llmc/x.cuh@2 ||| return 1; ||| return 0; ||| the second of two' >"$dir/dev/gpu_mutations.txt"
cat >"$dir/Makefile" <<'MK'
all: build/test_fp8 train_gpt2cu
build/test_fp8 train_gpt2cu: llmc/x.cuh
	mkdir -p build && echo built >$@ && echo "$@: llmc/x.cuh" >$@.d
MK
mkdir -p "$dir/build"
echo copied >"$dir/build/test_fp8"
(cd "$dir" && bash dev/gpu_mutation_runs.sh --check --stages test_fp8 --only second --jobs 1) >"$dir/out" 2>&1 ||
    { echo "FAIL: --check on the stand-in tree"; cat "$dir/out"; exit 1; }
grep -q "^note: build/test_fp8 has no dependency file" "$dir/out" && [ "$(cat "$dir/build/test_fp8")" = built ] &&
    [ -e "$dir/build/test_fp8.d" ] || { echo "FAIL: the copied program without its .d was kept"; cat "$dir/out"; exit 1; }
# With its .d it is kept (make all finds it up to date).
echo copied >"$dir/build/test_fp8"
touch "$dir/build/test_fp8"
(cd "$dir" && bash dev/gpu_mutation_runs.sh --check --stages test_fp8 --only second --jobs 1) >"$dir/out" 2>&1 ||
    { echo "FAIL: --check on the stand-in tree (second run)"; cat "$dir/out"; exit 1; }
! grep -q "^note:" "$dir/out" && [ "$(cat "$dir/build/test_fp8")" = copied ] ||
    { echo "FAIL: a program with its .d was rebuilt"; cat "$dir/out"; exit 1; }

# Unit tests at once share the cores and may time out for it: each of the P at once gets OMP_NUM_THREADS =
# cores / P, and a time-out beside others is run again alone before it counts. A stand-in nvidia-smi lets
# the pass run here; the stand-in test_fp8 waits past the limit while another instance holds a lock (the
# contention), passes alone, and fails alone when the mutation broke it.
mkdir -p "$dir/bin"
printf '#!/bin/sh\nexit 0\n' >"$dir/bin/nvidia-smi"
chmod +x "$dir/bin/nvidia-smi"
printf '%s\n' 'harmless ||| llmc/x.cuh@1 ||| return 1; ||| return  1; ||| an edit that changes nothing' \
    'broken ||| llmc/x.cuh@2 ||| return 1; ||| return 0; ||| an edit the stand-in test catches' >"$dir/dev/gpu_mutations.txt"
cat >"$dir/Makefile" <<'MK'
all: build/test_fp8 train_gpt2cu
train_gpt2cu: llmc/x.cuh
	mkdir -p build && echo built >$@ && echo "$@: llmc/x.cuh" >$@.d
build/test_fp8: llmc/x.cuh
	mkdir -p build && echo "$@: llmc/x.cuh" >$@.d
	{ echo '#!/bin/bash'; \
	  echo 'echo "$${OMP_NUM_THREADS:-unset}" >>"$$STANDIN_LOCK.omp"'; \
	  echo 'mkdir "$$STANDIN_LOCK" 2>/dev/null || exec sleep 60'; \
	  echo 'sleep 1; rmdir "$$STANDIN_LOCK"'; \
	  if grep -q 'return 0' llmc/x.cuh; then echo 'exit 1'; fi; } >$@ && chmod +x $@
MK
rm -rf "$dir/build"
(cd "$dir" && env -u OMP_NUM_THREADS PATH="$dir/bin:$PATH" STANDIN_LOCK="$dir/lock" GPU_MUTATION_UNIT_TIMEOUT=4 \
    bash dev/gpu_mutation_runs.sh --stages test_fp8 --no-baseline --test-jobs 2 --jobs 2 --out "$dir/t.tsv") \
    >"$dir/out" 2>&1 || { echo "FAIL: the pass on the stand-in tree"; cat "$dir/out"; exit 1; }
threads=$(($(nproc) / 2)); [ $threads -ge 1 ] || threads=1
grep -q "^note: .*: test_fp8 timed out beside 1 other test(s); running it again alone" "$dir/out" &&
    grep -q "^broken	killed	test_fp8$" "$dir/out" && grep -q "^harmless	.*	unfinished	" "$dir/out" &&
    [ "$(head -n 2 "$dir/lock.omp" | sort -u)" = "$threads" ] && [ "$(sed -n 3p "$dir/lock.omp")" = unset ] ||
    { echo "FAIL: a time-out beside another test was not run again alone, or the threads were not split"
      cat "$dir/out"; cat "$dir/lock.omp"; exit 1; }
echo "ok"
