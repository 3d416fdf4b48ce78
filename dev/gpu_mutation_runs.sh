#!/usr/bin/env bash
# A mutation pass over the GPU code: does `make test` on a GPU catch plausible bugs in the kernels and the
# trainer's GPU paths? The mutations are listed in dev/gpu_mutations.txt (ID, file, exact text, its
# replacement, the bug it stands for). For each one: the text is replaced in place (FILE@N picks the N-th
# of several occurrences), everything is rebuilt, the GPU tests run in order, fastest first, until one
# fails (the mutant is killed by it; a test that times out kills it too) or all pass (it survived); then
# the file is restored, also when the script is interrupted.
#   bash dev/gpu_mutation_runs.sh [--check] [--only ID,ID,...] [--from N] [--count K] [--out FILE]
#                                 [--time-budget SECONDS]
#   --check         without a GPU: only apply each mutation, check that it builds (train_gpt2cu), restore
#   --from/--count  the K mutations from the N-th (1-based), for passes split over several sessions
#   --out           the table, appended to (default build/gpu-mutations.tsv): id, file:line, the bug, result
#                   (killed, survived, no-build), the test that killed it, seconds
#   --time-budget   start no mutation after this many seconds (0: none)
# Before the first mutation the unmutated tree must build and pass every test below, or nothing is run.
# Tests (make test's GPU programs; script tests with fewer random trials to keep a mutant to ~1-2 min):
#   build/test_kernels test_gpt2_gpu test_zero_update test_dataloader_gpu test_checkpoint_gpu
#   test_device_file_io test_mc_eval_gpu test_multi_gpu, then test/test_train_gpt2cu.sh test_resume.sh
#   (RESUME_KILL_TRIALS=2) test_train_gpt2_cpu_vs_gpu.sh test_multi_gpu_trainer.sh test_hf_trainer.sh
#   test_run_survival.sh (SURVIVAL_TRIALS=2). A test that exits 77 (skip) kills nothing.
set -u
cd "$(dirname "$0")/.."
list=dev/gpu_mutations.txt
check=0 only="" from=1 count=100000 out=build/gpu-mutations.tsv budget=0
while [ $# -gt 0 ]; do
    case "$1" in
        --check) check=1; shift ;;
        --only) only=$2; shift 2 ;;
        --from) from=$2; shift 2 ;;
        --count) count=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --time-budget) budget=$2; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "gpu_mutation_runs: unknown argument '$1' (--help)" >&2; exit 2 ;;
    esac
done
if [ $check -eq 0 ] && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_mutation_runs: no NVIDIA GPU (use --check to only build the mutants)" >&2
    exit 2
fi
work=$(mktemp -d /tmp/gpu_mutations_XXXXXX)
restore() {
    if [ -n "${mutated:-}" ] && [ -f "$work/orig" ]; then cp "$work/orig" "$mutated"; fi
    mutated=""
}
trap 'restore; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

# apply FILE[@N] TEXT REPLACEMENT: replaces the N-th occurrence (default: the only one); prints its line.
apply() {
    python3 - "$1" "$2" "$3" <<'PY'
import sys
spec, text, repl = sys.argv[1], sys.argv[2], sys.argv[3]
path, _, nth = spec.partition("@")
src = open(path).read()
n = src.count(text)
if nth:
    k = int(nth)
    if not 1 <= k <= n:
        sys.exit(f"{path}: occurrence {k} of the text asked for, {n} found")
else:
    k = 1
    if n != 1:
        sys.exit(f"{path}: the text occurs {n} times (give FILE@N)")
pos = -1
for _ in range(k):
    pos = src.index(text, pos + 1)
open(path, "w").write(src[:pos] + repl + src[pos + len(text):])
print(src.count("\n", 0, pos) + 1)
PY
}

units=(test_kernels test_gpt2_gpu test_zero_update test_dataloader_gpu test_checkpoint_gpu test_device_file_io
       test_mc_eval_gpu test_multi_gpu)
scripts=("test_train_gpt2cu.sh" "test_resume.sh RESUME_KILL_TRIALS=2" "test_train_gpt2_cpu_vs_gpu.sh"
         "test_multi_gpu_trainer.sh" "test_hf_trainer.sh" "test_run_survival.sh SURVIVAL_TRIALS=2")
# run_tests LOG: the first failing test's name on stdout ("" when all pass).
run_tests() {
    local log=$1 t rc
    for t in "${units[@]}"; do
        timeout -k 10 300 "build/$t" >>"$log" 2>&1; rc=$?
        if [ $rc -ne 0 ] && [ $rc -ne 77 ]; then echo "$t$([ $rc -eq 124 ] && echo ' (timeout)')"; return; fi
    done
    for t in "${scripts[@]}"; do
        set -- $t
        local name=$1; shift
        env "$@" timeout -k 10 400 bash "test/$name" >>"$log" 2>&1; rc=$?
        if [ $rc -ne 0 ] && [ $rc -ne 77 ]; then echo "$name$([ $rc -eq 124 ] && echo ' (timeout)')"; return; fi
    done
    echo ""
}

build() {  # build LOG
    if [ $check -eq 1 ]; then make -j"$(nproc)" train_gpt2cu >>"$1" 2>&1; else make -j"$(nproc)" all >>"$1" 2>&1; fi
}

mkdir -p "$(dirname "$out")"
[ -s "$out" ] || printf 'id\tfile:line\tthe bug\tresult\tkilled by\tseconds\n' >"$out"
if [ $check -eq 0 ]; then
    t0=$SECONDS
    echo "baseline: building and running every test on the unmutated tree"
    build "$work/baseline.log" || { echo "FAIL: the unmutated tree does not build (log $work/baseline.log)"; tail -20 "$work/baseline.log"; exit 1; }
    killer=$(run_tests "$work/baseline.log")
    if [ -n "$killer" ]; then
        echo "FAIL: the unmutated tree fails $killer; no mutation run"; tail -30 "$work/baseline.log"; exit 1
    fi
    echo "baseline: all tests pass ($((SECONDS - t0)) s)"
fi

index=0 done_count=0 killed=0 survived=0 nobuild=0
start=$SECONDS
while IFS= read -r line; do
    case "$line" in '#'*|'') continue ;; esac
    index=$((index + 1))
    [ $index -lt "$from" ] && continue
    [ $done_count -ge "$count" ] && break
    mid=$(awk -F' \\|\\|\\| ' '{print $1}' <<<"$line")
    if [ -n "$only" ] && [[ ",$only," != *",$mid,"* ]]; then continue; fi
    if [ "$budget" -gt 0 ] && [ $((SECONDS - start)) -ge "$budget" ]; then echo "time budget spent before mutation $index ($mid)"; break; fi
    IFS=$'\x1f' read -r mid spec text repl what < <(python3 -c '
import sys
f = [x.strip() for x in sys.argv[1].split(" ||| ")]
if len(f) != 5: sys.exit("bad line: " + sys.argv[1])
print("\x1f".join(f))' "$line")
    file=${spec%@*}
    cp "$file" "$work/orig"
    mutated=$file
    if ! lineno=$(apply "$spec" "$text" "$repl" 2>"$work/apply.err"); then
        restore
        echo "FAIL: mutation $mid does not apply: $(cat "$work/apply.err")"; exit 1
    fi
    t0=$SECONDS
    log="$work/$mid.log"
    if ! build "$log"; then
        result=no-build killer="" nobuild=$((nobuild + 1))
    elif [ $check -eq 1 ]; then
        result=builds killer=""
    else
        killer=$(run_tests "$log")
        if [ -n "$killer" ]; then result=killed killed=$((killed + 1)); else result=survived survived=$((survived + 1)); fi
    fi
    restore
    done_count=$((done_count + 1))
    printf '%s\t%s:%s\t%s\t%s\t%s\t%s\n' "$mid" "$file" "$lineno" "$what" "$result" "$killer" "$((SECONDS - t0))" |
        tee -a "$out"
done <"$list"
if [ $check -eq 0 ]; then
    total=$((killed + survived))
    echo "mutations run: $done_count; killed $killed, survived $survived, did not build $nobuild$([ $total -gt 0 ] &&
        echo "; $((100 * killed / total))% of those that built killed") (table: $out)"
else
    echo "mutants checked: $done_count; did not build: $nobuild (table: $out)"
    [ $nobuild -eq 0 ]
fi
