#!/usr/bin/env bash
# A mutation pass over the GPU code: does `make test` on a GPU catch plausible bugs in the kernels and the
# trainer's GPU paths? The mutations are listed in dev/gpu_mutations.txt (ID, file, exact text, its
# replacement, the bug it stands for; FILE@N picks the N-th of several occurrences).
#   bash dev/gpu_mutation_runs.sh [--check | --verify] [--only ID,ID,...] [--from N] [--count K] [--out FILE]
#                                 [--jobs J] [--test-jobs P] [--no-baseline | --baseline-only]
#                                 [--time-budget SECONDS] [--stages NAME,NAME,...]
#   --check         without a GPU: only make each mutant's tree and check that its trainer builds
#   --verify        without a GPU or a build: only check that each mutation's text is in its file as the list
#                   says (once, or at least N times for FILE@N), so that the list keeps up with the code
#   --only/--from/--count  which mutations (IDs; or the K from the N-th, 1-based), for passes split in parts
#   --out           the table, appended to (default build/gpu-mutations.tsv): id, file:line, the bug, result
#                   (killed, survived, no-build), the test that killed it, seconds of its tests
#   --jobs          builds at once (default: the cores)
#   --test-jobs     unit-test programs at once on the GPU (default 4); script tests always run one at a time,
#                   some of them time signals and deadlines. The programs at once share the cores: each gets
#                   OMP_NUM_THREADS = cores / J for its CPU reference (unless OMP_NUM_THREADS is set), since
#                   OpenMP threads spinning on a shared core can slow a test past its time limit; and a test
#                   that times out beside others is run again alone before it counts as a kill. test_gpt2_gpu
#                   spends most of its ~150 s in its CPU reference, so at once its runs gain nothing: give
#                   its stage --test-jobs 1
#   --no-baseline   skip the run of every test on the unmutated tree (only when it ran at the same commit
#                   on the same machine; the script says so in its summary)
#   --baseline-only only build the unmutated tree and run every test on it (then --no-baseline in a later run)
#   --time-budget   start no stage after this many seconds (0: none); mutants left are reported unfinished
#   --stages        only these stages (names below: test_checkpoint_gpu, test_resume.sh, ...), in this order, for the
#                   baseline and the mutants: e.g. a mutant the list expects test_checkpoint_gpu to kill is judged
#                   without first waiting for test_gpt2_gpu. A mutant alive after a pass with some stages
#                   left out (by --stages, or failing on the unmutated tree) is reported unfinished, not
#                   survived
#
# How: the repository is built once (make all; with --stages, only those stages' programs) and, unless
# --no-baseline, every test below runs on it; one that fails there cannot tell a mutant apart and is left
# out of the pass (the summary counts them).
# Each mutant is a copy of the built tree (data/ and .deps/ linked, not copied) with its one edit, so the
# repository itself is never changed. The tests run in stages, fastest first; at each stage the mutants
# still alive rebuild, in parallel, only what the edit touches (make's dependency files decide); a stage
# whose programs the edit does not touch cannot fail differently from the unmutated tree and is skipped
# for that mutant. A mutant is killed by the first test that fails (or times out) and survives when all
# pass. A test that exits 77 (skipped) kills nothing. A mutant's unit programs run with GTEST_FAIL_FAST=1:
# they stop at their first failing case.
# Stages: build/test_kernels test_gpt2_gpu test_zero_update test_dataloader_gpu test_checkpoint_gpu
#   test_device_file_io test_mc_eval_gpu test_multi_gpu (make test's GPU programs), then the GPU script
#   tests test_train_gpt2cu.sh test_resume.sh test_train_gpt2_cpu_vs_gpu.sh test_multi_gpu_trainer.sh
#   test_hf_trainer.sh test_run_survival.sh, with fewer random kill and signal trials (RESUME_KILL_TRIALS=2,
#   SURVIVAL_TRIALS=2) to keep a surviving mutant to a few minutes.
set -u
cd "$(dirname "$0")/.."
root=$(pwd)
list=dev/gpu_mutations.txt
check=0 verify=0 only="" from=1 count=100000 out=build/gpu-mutations.tsv budget=0 jobs=$(nproc) test_jobs=4 baseline=1
only_stages=""
while [ $# -gt 0 ]; do
    case "$1" in
        --check) check=1; shift ;;
        --verify) verify=1; shift ;;
        --only) only=$2; shift 2 ;;
        --from) from=$2; shift 2 ;;
        --count) count=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --jobs) jobs=$2; shift 2 ;;
        --test-jobs) test_jobs=$2; shift 2 ;;
        --no-baseline) baseline=0; shift ;;
        --baseline-only) baseline=2; shift ;;
        --time-budget) budget=$2; shift 2 ;;
        --stages) only_stages=$2; shift 2 ;;
        -h|--help) sed -n "2,$(($(grep -n '^set -u' "$0" | head -1 | cut -d: -f1) - 1))p" "$0"; exit 0 ;;
        *) echo "gpu_mutation_runs: unknown argument '$1' (--help)" >&2; exit 2 ;;
    esac
done
if [ $check -eq 0 ] && [ $verify -eq 0 ] && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_mutation_runs: no NVIDIA GPU (use --check to only build the mutants)" >&2
    exit 2
fi
work=$(mktemp -d /tmp/gpu_mutations_XXXXXX)
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
start=$SECONDS

# Stages: "unit NAME" (build/NAME) or "script NAME [VAR=VALUE ...]" (test/NAME; what it runs, built first).
stages=("unit test_kernels" "unit test_gpt2_gpu" "unit test_zero_update" "unit test_dataloader_gpu"
        "unit test_checkpoint_gpu" "unit test_device_file_io" "unit test_mc_eval_gpu" "unit test_multi_gpu"
        "script test_train_gpt2cu.sh" "script test_resume.sh RESUME_KILL_TRIALS=2"
        "script test_train_gpt2_cpu_vs_gpu.sh" "script test_multi_gpu_trainer.sh" "script test_hf_trainer.sh"
        "script test_run_survival.sh SURVIVAL_TRIALS=2")
all_stages=${#stages[@]}
if [ -n "$only_stages" ]; then  # --stages: pick and order them
    picked=()
    for want in ${only_stages//,/ }; do
        found=""
        for s in "${stages[@]}"; do
            set -- $s
            [ "$2" = "$want" ] && found=$s
        done
        [ -n "$found" ] || { echo "gpu_mutation_runs: no stage '$want' (--help lists them)" >&2; exit 2; }
        picked+=("$found")
    done
    stages=("${picked[@]}")
fi
script_targets="train_gpt2cu train_gpt2 build/convert_model build/inspect_checkpoint"
stage_targets() {  # stage_targets KIND NAME
    if [ "$1" = unit ]; then echo "build/$2"; else echo "$script_targets"; fi
}
# run_stage DIR KIND NAME [VAR=VALUE ...] >>LOG: the test's exit code (124: timed out). A unit test's limit is
# GPU_MUTATION_UNIT_TIMEOUT seconds (default 300; the slowest, test_gpt2_gpu, takes ~150 s alone on an H100).
unit_timeout=${GPU_MUTATION_UNIT_TIMEOUT:-300}
run_stage() {
    local dir=$1 kind=$2 name=$3
    shift 3
    if [ "$kind" = unit ]; then
        (cd "$dir" && timeout -k 10 "$unit_timeout" "build/$name")
    else
        (cd "$dir" && env "$@" timeout -k 10 400 bash "test/$name")
    fi
}

# The mutations: index, id, file spec, text, replacement, the bug (fields split by \x1f).
python3 - "$list" >"$work/mutations" <<'PY' || exit 1
import sys
n = 0
for line in open(sys.argv[1]):
    line = line.rstrip("\n")
    if not line.strip() or line.startswith("#"):
        continue
    f = [x.strip() for x in line.split(" ||| ")]
    if len(f) != 5:
        sys.exit("gpu_mutations.txt: a line without 5 fields: " + line[:120])
    n += 1
    print("\x1f".join([str(n)] + f))
PY
selected=()
while IFS=$'\x1f' read -r idx mid spec text repl what; do
    [ "$idx" -lt "$from" ] && continue
    [ ${#selected[@]} -ge "$count" ] && break
    if [ -n "$only" ] && [[ ",$only," != *",$mid,"* ]]; then continue; fi
    selected+=("$mid")
    printf '%s\x1f%s\x1f%s\x1f%s\n' "$spec" "$text" "$repl" "$what" >"$work/$mid.mutation"
done <"$work/mutations"
[ ${#selected[@]} -gt 0 ] || { echo "gpu_mutation_runs: no mutation selected" >&2; exit 2; }

# apply DIR SPEC TEXT REPLACEMENT [dry]: edits DIR/FILE (the N-th occurrence for FILE@N, else the only
# one); prints the line number. With "dry", only checks that the text is there as the spec says.
apply() {
    python3 - "$1" "$2" "$3" "$4" "${5:-}" <<'PY'
import sys
d, spec, text, repl, dry = sys.argv[1:6]
path, _, nth = spec.partition("@")
src = open(f"{d}/{path}").read()
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
if not dry:
    open(f"{d}/{path}", "w").write(src[:pos] + repl + src[pos + len(text):])
print(src.count("\n", 0, pos) + 1)
PY
}

if [ $verify -eq 1 ]; then
    bad=0
    for mid in "${selected[@]}"; do
        IFS=$'\x1f' read -r spec text repl what <"$work/$mid.mutation"
        at=$(apply "$root" "$spec" "$text" "$repl" dry 2>&1) || { echo "BAD  $mid: $at"; bad=$((bad + 1)); continue; }
        echo "ok   $mid (${spec%@*}:$at)"
    done
    echo "${#selected[@]} mutations, $bad whose text is not where the list says"
    [ $bad -eq 0 ]
    exit $?
fi

# A mutant is judged only by the stages whose programs make would rebuild after its edit, which make can
# tell only from the dependency file it wrote with the program (-MMD). A program that came from elsewhere
# (copied in, without its .d) would look up to date after any header's edit, and its mutants would go
# untested: such programs are removed here so that make all builds them with their dependency files.
for s in "${stages[@]}"; do
    set -- $s
    for t in $(stage_targets "$1" "$2"); do
        if [ -e "$t" ] && [ ! -e "$t.d" ]; then
            echo "note: $t has no dependency file ($t.d): rebuilding it, or its mutants' edits would not reach it"
            rm -f "$t"
        fi
    done
done
# With --stages (and not --check, whose mutants build the trainer) only those stages' programs are built:
# a pass over a few stages then waits for a few programs, not for the whole tree.
base_targets=all
if [ -n "$only_stages" ] && [ $check -eq 0 ]; then
    base_targets=$(for s in "${stages[@]}"; do set -- $s; stage_targets "$1" "$2"; done | tr ' ' '\n' | sort -u | tr '\n' ' ')
fi
echo "building the unmutated tree (make $base_targets)"
if ! make -j"$jobs" $base_targets >"$work/baseline-build.log" 2>&1; then
    echo "FAIL: the unmutated tree does not build"; tail -20 "$work/baseline-build.log"; exit 1
fi
baseline_failed=0
if [ $check -eq 0 ] && [ $baseline -ge 1 ]; then
    kept=()
    for s in "${stages[@]}"; do
        set -- $s
        t0=$SECONDS
        run_stage "$root" "$@" >"$work/baseline.log" 2>&1; rc=$?
        if [ $rc -ne 0 ] && [ $rc -ne 77 ]; then
            # It cannot tell a mutant from the unmutated tree: the pass goes on without it, and says so.
            echo "FAIL: the unmutated tree fails $2 (exit $rc); the mutants are not judged by it"
            tail -30 "$work/baseline.log" | sed 's/^/  baseline: /'
            baseline_failed=$((baseline_failed + 1))
            continue
        fi
        kept+=("$s")
        echo "baseline: $2 $([ $rc -eq 77 ] && echo skipped || echo passes) ($((SECONDS - t0)) s)"
    done
    stages=("${kept[@]}")
    [ $baseline -eq 2 ] && [ $baseline_failed -gt 0 ] && exit 1
    if [ $baseline -eq 2 ]; then
        echo "baseline: every test passes on the unmutated tree ($((SECONDS - start)) s)"; exit 0
    fi
fi


# Each mutant's tree: the built repository (timestamps kept, so make rebuilds only what the edit touches),
# with the edit applied after the copy.
declare -A status killer line seconds
alive=()
for mid in "${selected[@]}"; do
    d=$work/m/$mid
    mkdir -p "$d"
    for e in "$root"/* "$root"/.ci; do
        [ -e "$e" ] || continue
        b=$(basename "$e")
        case "$b" in data|out|carry) continue ;; esac
        cp -a "$e" "$d/"
    done
    rm -rf "$d/build/test-logs"
    [ -e "$root/data" ] && ln -s "$root/data" "$d/data"
    [ -e "$root/.deps" ] && ln -s "$root/.deps" "$d/.deps"
    IFS=$'\x1f' read -r spec text repl what <"$work/$mid.mutation"
    sleep 0.01  # the edit's time stamp is after every copied build output's
    if ! line[$mid]=$(apply "$d" "$spec" "$text" "$repl" 2>"$work/$mid.apply"); then
        echo "FAIL: mutation $mid does not apply: $(cat "$work/$mid.apply")"; exit 1
    fi
    status[$mid]=alive killer[$mid]="" seconds[$mid]=0
    alive+=("$mid")
done
echo "mutant trees: ${#alive[@]} ($((SECONDS - start)) s)"

# record MID RESULT: the mutant's row, printed and appended to the table at once (a pass cut short keeps
# what it found).
mkdir -p "$(dirname "$out")"
[ -s "$out" ] || printf 'id\tfile:line\tthe bug\tresult\tkilled by\tseconds\n' >"$out"
declare -A recorded
record() {
    local mid=$1 result=$2 spec text repl what row
    IFS=$'\x1f' read -r spec text repl what <"$work/$mid.mutation"
    row=$(printf '%s\t%s:%s\t%s\t%s\t%s\t%s' "$mid" "${spec%@*}" "${line[$mid]}" "$what" "$result" "${killer[$mid]}" \
        "${seconds[$mid]}")
    echo "$row"
    if [ "$result" != unfinished ]; then echo "$row" >>"$out"; fi
    recorded[$mid]=1
}

# build_all TARGETS MUTANTS...: builds TARGETS in each mutant's tree, $jobs at once; a failed build marks
# the mutant no-build.
build_all() {
    local targets=$1
    shift
    printf '%s\n' "$@" | xargs -P "$jobs" -I{} bash -c \
        'make -C "$1/m/$2" -s $3 >"$1/$2.build.log" 2>&1 || touch "$1/$2.nobuild"' _ "$work" {} "$targets"
    local mid
    for mid in "$@"; do
        if [ -e "$work/$mid.nobuild" ] && [ "${status[$mid]}" != no-build ]; then
            status[$mid]=no-build
            [ $check -eq 0 ] && record "$mid" no-build
        fi
    done
}

if [ $check -eq 1 ]; then
    build_all train_gpt2cu "${alive[@]}"
    nobuild=0
    for mid in "${alive[@]}"; do
        [ "${status[$mid]}" = no-build ] && { nobuild=$((nobuild + 1)); echo "$mid: does not build"; }
    done
    echo "mutants checked: ${#alive[@]}; did not build: $nobuild"
    [ $nobuild -eq 0 ]
    exit
fi

stopped=0
for s in "${stages[@]}"; do
    if [ "$budget" -gt 0 ] && [ $((SECONDS - start)) -ge "$budget" ]; then
        echo "time budget spent before stage '$s'"; stopped=1; break
    fi
    set -- $s
    kind=$1 name=$2
    targets=$(stage_targets "$kind" "$name")
    # Mutants this stage can tell apart from the unmutated tree: those whose edit reaches its programs.
    touched=()
    for mid in "${alive[@]}"; do
        [ "${status[$mid]}" = alive ] || continue
        if ! make -C "$work/m/$mid" -q $targets >/dev/null 2>&1; then touched+=("$mid"); fi
    done
    [ ${#touched[@]} -eq 0 ] && continue
    t0=$SECONDS
    build_all "$targets" "${touched[@]}"
    echo "stage $name: ${#touched[@]} mutants built in $((SECONDS - t0)) s"
    runnable=()
    for mid in "${touched[@]}"; do [ "${status[$mid]}" = alive ] && runnable+=("$mid"); done
    [ ${#runnable[@]} -eq 0 ] && continue
    # run_one MID: the test in the mutant's tree; writes the exit code and seconds to files.
    export -f run_stage
    export unit_timeout
    P=$([ "$kind" = unit ] && echo "$test_jobs" || echo 1)
    [ "$P" -gt ${#runnable[@]} ] && P=${#runnable[@]}
    # The P programs at once split the cores between their OpenMP CPU references.
    omp=${OMP_NUM_THREADS:-}
    if [ -z "$omp" ] && [ "$P" -gt 1 ]; then omp=$(($(nproc) / P)); [ "$omp" -ge 1 ] || omp=1; fi
    run_one='
        t0=$(date +%s.%N)
        if [ -n "$omp" ]; then export OMP_NUM_THREADS=$omp; fi
        export GTEST_FAIL_FAST=1  # the first failure kills the mutant: the rest of the program need not run
        run_stage "$1/m/$2" "${@:3}" >>"$1/$2.log" 2>&1
        echo $? >"$1/$2.rc"
        python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1])))" "$t0" "$(date +%s.%N)" \
            >"$1/$2.secs"'
    printf '%s\n' "${runnable[@]}" | omp=$omp xargs -P "$P" -I{} bash -c "$run_one" _ "$work" {} $s
    # A time-out beside other tests may be theirs, not the mutant's: such a test runs again alone, on every
    # core, and that run decides.
    if [ "$P" -gt 1 ]; then
        for mid in "${runnable[@]}"; do
            [ "$(cat "$work/$mid.rc")" -eq 124 ] || continue
            echo "note: $mid: $name timed out beside $((P - 1)) other test(s); running it again alone"
            secs=$(cat "$work/$mid.secs")
            seconds[$mid]=$((${seconds[$mid]} + secs))
            omp=${OMP_NUM_THREADS:-} bash -c "$run_one" _ "$work" "$mid" $s
        done
    fi
    for mid in "${runnable[@]}"; do
        rc=$(cat "$work/$mid.rc") secs=$(cat "$work/$mid.secs")
        seconds[$mid]=$((${seconds[$mid]} + secs))
        if [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ]; then
            status[$mid]=killed killer[$mid]="$name$([ "$rc" -eq 124 ] && echo ' (timeout)')"
            record "$mid" killed
        fi
    done
    echo "stage $name: ran ${#runnable[@]}, killed $(for m in "${runnable[@]}"; do [ "${status[$m]}" = killed ] &&
        echo; done | wc -l) ($((SECONDS - start)) s since the start)"
    still=()
    for mid in "${alive[@]}"; do [ "${status[$mid]}" = alive ] && still+=("$mid"); done
    alive=("${still[@]}")
    [ ${#alive[@]} -eq 0 ] && break
done

killed=0 survived=0 nobuild=0 unfinished=0
echo "the table:"
for mid in "${selected[@]}"; do
    result=${status[$mid]}
    if [ "$result" = alive ]; then
        if [ $stopped -eq 0 ] && [ ${#stages[@]} -eq "$all_stages" ]; then result=survived; else result=unfinished; fi
    fi
    case $result in
        killed) killed=$((killed + 1)) ;; survived) survived=$((survived + 1)) ;;
        no-build) nobuild=$((nobuild + 1)) ;; unfinished) unfinished=$((unfinished + 1)) ;;
    esac
    if [ -n "${recorded[$mid]:-}" ]; then
        printf '%s\t%s\t%s\n' "$mid" "$result" "${killer[$mid]}"
    else
        record "$mid" "$result"
    fi
    if [ "$result" = survived ] || [ "$result" = no-build ]; then
        tail -5 "$work/$mid.log" 2>/dev/null | sed "s/^/  $mid: /"
        [ "$result" = no-build ] && tail -5 "$work/$mid.build.log" | sed "s/^/  $mid: /"
    fi
done
total=$((killed + survived))
echo "mutations: ${#selected[@]}; killed $killed, survived $survived, did not build $nobuild, unfinished $unfinished$(
    [ $total -gt 0 ] && echo "; $((100 * killed / total))% of those run to the end killed")" \
    "(table: $out; baseline $([ $baseline -eq 1 ] && echo "run here, $baseline_failed test(s) failing and left out" ||
        echo 'not run here');" \
    "$((SECONDS - start)) s)"
