#!/usr/bin/env bash
# The project's GPU measurements in named sections, for any machine with an NVIDIA GPU: build, GPU tests,
# sanitizer, benchmarks, the trainer against PyTorch and llm.c, Nsight Compute details of its kernels. Each
# section's log goes to $LOGS (default build/gpu-logs) and a summary (date, commit, GPU, then one line per step and the figures
# each section reports) is printed last and kept in $LOGS/summary.txt. docs/performance.md says which
# sections made which figures.
#   bash dev/gpu_runs.sh SECTION...
#   sections: build tests io-tests sanitizer bench-io dataloader kernels trainer throughput quickstart
#             long-tests resume bench-checkpoint torch torch-mild torch-hot torch-throughput throughput-large
#             attention-detail profile compare llmc
#   e.g.  bash dev/gpu_runs.sh build throughput torch-throughput
# Environment: LOGS (log folder); TIME_BUDGET (seconds, default 0: none): when set, no step starts or runs
# past it, so a run under an outer time limit still prints its summary; BUILD_TARGETS (what `build` makes,
# default all); the per-section knobs named below (IO_SIZES, LARGE_BS, DYN_EXTRA, ATTN_KERNELS, COMPARE,
# LLMC_PEER). A numerics change against bf16's own spread: dev/spread.sh.
# Most sections need data/ from `make data`.
set -u
cd "$(dirname "$0")/.."
# The sections, as the case below names them: a misspelt one stops the script before anything runs.
sections="build tests io-tests sanitizer bench-io dataloader kernels trainer throughput quickstart long-tests
          resume bench-checkpoint torch torch-mild torch-hot torch-throughput throughput-large attention-detail
          profile compare llmc"
[ $# -gt 0 ] || { echo "usage: bash dev/gpu_runs.sh SECTION... (sections: $(echo $sections))" >&2; exit 2; }
for section in "$@"; do
    case " $(echo $sections) " in
        *" $section "*) ;;
        *) echo "gpu_runs.sh: unknown section '$section' (sections: $(echo $sections))" >&2; exit 2 ;;
    esac
done
LOGS=${LOGS:-build/gpu-logs}
TIME_BUDGET=${TIME_BUDGET:-0}
mkdir -p "$LOGS"
summary="$LOGS/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

step() {  # step NAME LOGFILE TIMEOUT_S CMD...
    local name=$1 log=$2 limit=$3
    shift 3
    local t0=$SECONDS
    if [ "$TIME_BUDGET" -gt 0 ]; then
        local left=$((TIME_BUDGET - SECONDS))
        if [ "$left" -lt 10 ]; then note "$(printf '%-28s not run: TIME_BUDGET spent' "$name")"; return 1; fi
        [ "$limit" -gt "$left" ] && limit=$left
    fi
    echo "=== $name: $*" >>"$LOGS/$log"
    timeout "$limit" "$@" >>"$LOGS/$log" 2>&1
    local rc=$?
    note "$(printf '%-28s rc=%-3s %4ss  (log %s)' "$name" "$rc" "$((SECONDS - t0))" "$log")"
    return $rc
}

# nvidia-smi's SM clock, power and clock-event reasons (0x4: the software power cap) every 250 ms while
# something runs (smi_start; ...; smi_stop; smi_summary NAME, or smi_run below); the samples stay in $LOGS/NAME.
smi_start() {
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
        --format=csv,noheader -lms 250 >"$LOGS/smi.tmp" 2>&1 &
    smi_pid=$!
}
smi_stop() { kill "$smi_pid" 2>/dev/null; wait "$smi_pid" 2>/dev/null; }
# smi_run NAME CMD...: CMD (e.g. a step) with the samples taken while it runs, then their summary.
smi_run() {
    local name=$1 rc
    shift
    smi_start
    "$@"
    rc=$?
    smi_stop
    smi_summary "$name"
    return $rc
}
smi_summary() {
    mv "$LOGS/smi.tmp" "$LOGS/$1"
    python3 - "$LOGS/$1" <<'PY' | tee -a "$summary"
import statistics, sys
rows = [[f.strip() for f in l.split(",")] for l in open(sys.argv[1]) if l.count(",") >= 5]
busy = [r for r in rows if float(r[3].split()[0]) > 200]  # samples while the GPU works hard
if busy:
    for name, i in (("SM clock MHz", 1), ("memory clock MHz", 2), ("power W", 3), ("temperature C", 4)):
        v = sorted(float(r[i].split()[0]) for r in busy)
        print(f"{name}: min {v[0]:.0f} median {statistics.median(v):.0f} max {v[-1]:.0f} ({len(v)} samples)")
    print("event reasons:", sorted({r[5] for r in busy}))
PY
}

# What the figures were measured on: every one of them is quoted with its date, commit and GPU.
commit=unknown
if git rev-parse --short HEAD >/dev/null 2>&1; then
    commit=$(git rev-parse --short HEAD)
    git diff --quiet HEAD || commit="$commit (with local changes)"
fi
note "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit"
gpu=$(nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader 2>/dev/null | head -n 1)
note "GPU: ${gpu:-none found (nvidia-smi)}"
for section in "$@"; do
    case $section in
        build)
            nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader | tee -a "$summary"
            step build build.log 400 make -k -j"$(nproc)" ${BUILD_TARGETS:-all} ;;
        tests)
            step "make test" tests.log 400 make test
            tail -n 1 "$LOGS/tests.log" | tee -a "$summary" ;;
        io-tests)
            step test_device_file_io tests.log 120 ./build/test_device_file_io ;;
        sanitizer)
            step "sanitizer test_device_file_io" sanitizer.log 400 \
                compute-sanitizer --tool memcheck --target-processes application-only ./build/test_device_file_io
            grep -h "ERROR SUMMARY" "$LOGS/sanitizer.log" | tee -a "$summary" ;;
        bench-io)
            step "bench_io file-io" bench_io.log 500 ./build/bench_io file-io --dir /tmp --sizes-gib "${IO_SIZES:-1,4}" --reps 3
            grep -E "target|peak extra" "$LOGS/bench_io.log" | tee -a "$summary" ;;
        dataloader)
            step test_dataloader_gpu tests.log 200 ./build/test_dataloader_gpu
            step "bench_io dataloader" bench_dataloader.log 300 ./build/bench_io dataloader
            tail -n 12 "$LOGS/bench_dataloader.log" >>"$summary" ;;
        kernels)
            step test_kernels kernels.log 300 ./build/test_kernels ;;
        trainer)
            step test_gpt2_gpu trainer.log 200 ./build/test_gpt2_gpu
            step test_train_gpt2cu.sh trainer.log 150 bash test/test_train_gpt2cu.sh ;;
        throughput)
            for B in 16 64; do
                smi=()  # the clock is sampled in the B=64 run, the one docs/performance.md reports it for
                [ $B = 64 ] && smi=(smi_run smi_ours_b64.log)
                "${smi[@]}" step "train_gpt2cu d12 B=$B" throughput.log 120 ./train_gpt2cu -e d12 -b $B -t 1024 -x 30 -v 0 -s 0 -o ""
                tail -n 6 "$LOGS/throughput.log" >>"$summary"
                grep -E "^\| (activations|activation gradients|scratch|model total)|in use after allocation" \
                    "$LOGS/throughput.log" | tail -n 5 >>"$summary"
            done ;;
        llmc)
            # The llm.c peer (its bench_llmc.sh builds and runs llm.c d12 T=1024 at B=64 and 16), for a
            # comparison in the same run: LLMC_PEER is the folder holding bench_llmc.sh.
            step "llm.c (bench_llmc.sh)" llmc.log 300 bash "${LLMC_PEER:-peers}/bench_llmc.sh" 64 16
            grep "^LLMC" "$LOGS/llmc.log" | tee -a "$summary" ;;
        throughput-large)
            # The larger models: d24 and d48 at T=1024, the largest of these B that fits, without and with
            # recompute (-r 1). A B that does not fit fails at start-up (allocation), in about a second.
            for model in d24 d48; do
                for r in 0 1; do
                    for B in ${LARGE_BS:-128 112 96 80 64 56 48 40 32 24 16 8 4}; do
                        if step "train_gpt2cu $model B=$B -r $r" throughput_large.log 150 \
                            ./train_gpt2cu -e $model -b $B -t 1024 -r $r -x 12 -v 0 -s 0 -o ""; then
                            grep -E "^average|^peak" "$LOGS/throughput_large.log" | tail -n 2 >>"$summary"
                            break
                        fi
                    done
                done
            done ;;
        long-tests)
            step "test_gpt2_gpu T=1024" trainer.log 400 env LLMC_LONG_TESTS=1 ./build/test_gpt2_gpu --gtest_filter='*T_1024*' ;;
        resume)
            step test_resume.sh trainer.log 500 bash test/test_resume.sh ;;
        bench-checkpoint)
            step "bench_io checkpoint" bench_checkpoint.log 300 ./build/bench_io checkpoint /tmp/bench_checkpoint 3
            tail -n 12 "$LOGS/bench_checkpoint.log" >>"$summary" ;;
        torch)
            # The training-dynamics check against PyTorch: the same d12 start and batches, 300 steps each. The batches are
            # shuffled (the same --shuffle 1 --seed for both; dev/train_gpt2_torch.py ports the DataLoader's order,
            # test/test_torch_ref_order.sh checks it), since in file order the loss jumps at the corpus's shard boundaries.
            # "hot": B=16 (16K tokens per step) at lr 6e-4 after 30 warmup steps; "calm": 4 micro-steps
            # (64K tokens per step) and 100 warmup steps. torch fp32 (no autocast, no TF32) on the hot setting gives
            # the noise floor: how far bf16 itself moves PyTorch's own losses. The JSONL logs are kept in $LOGS/dynamics.tgz.
            hot=(-b 16 -t 1024 -x 300 -l 6e-4 -u 30 -q 0.1 -c 0.1 -k cosine -v 100 -m 10)
            calm=(-b 16 -t 1024 -d 65536 -x 300 -l 6e-4 -u 100 -q 0.1 -c 0.1 -k cosine -v 100 -m 10)
            order=(--shuffle 1 --seed 1337)
            step "d12 init" torch.log 120 ./train_gpt2cu -e d12 -x 0 -v 0 -s 0 --save-model llmc -o out/init
            for cfg in hot calm; do
                declare -n hp=$cfg
                step "ours 300 steps ($cfg)" torch.log 200 ./train_gpt2cu -e out/init/model.bin "${order[@]}" "${hp[@]}" -s 0 -o out/ours_$cfg
                mkdir -p out/dynamics && cp out/ours_$cfg/log.jsonl out/dynamics/ours_$cfg.jsonl
                step "torch 300 steps ($cfg) + compare" torch.log 300 python3 dev/train_gpt2_torch.py -e out/init/model.bin "${order[@]}" "${hp[@]}" \
                    --compare out/ours_$cfg/log.jsonl --log out/dynamics/torch_$cfg.jsonl
                grep -E "PASS|FAIL" "$LOGS/torch.log" | tail -n 1 | sed "s/^/$cfg: /" >>"$summary"
                unset -n hp
            done
            step "torch fp32 300 steps (hot)" torch.log 300 python3 dev/train_gpt2_torch.py -e out/init/model.bin "${order[@]}" "${hot[@]}" \
                --precision fp32 --compare out/dynamics/torch_hot.jsonl --log out/dynamics/torch_fp32_hot.jsonl
            grep -E "PASS|FAIL" "$LOGS/torch.log" | tail -n 1 | sed "s/^/torch fp32 vs torch bf16 (hot): /" >>"$summary"
            tar czf "$LOGS/dynamics.tgz" -C out dynamics ;;
        torch-mild|torch-hot)
            # The training-dynamics check in one setting, quickly: ours against one torch bf16 run
            # (train_gpt2_torch.py --compare), and torch fp32 against torch bf16. hot: the setting of the torch section
            # (B=16, lr 6e-4, 30 warmup steps); mild: the same at lr 3e-4. Logs in $LOGS/dynamics_NAME.tgz.
            name=${section#torch-}
            lr=6e-4
            [ "$name" = mild ] && lr=3e-4
            hp=(-b 16 -t 1024 -x 300 -l $lr -u 30 -q 0.1 -c 0.1 -k cosine -v 100 -m 10)
            order=(--shuffle 1 --seed 1337)
            mkdir -p out/dynamics
            [ -f out/init/model.bin ] || step "d12 init" torch.log 120 ./train_gpt2cu -e d12 -x 0 -v 0 -s 0 --save-model llmc -o out/init
            step "ours 300 steps ($name)" torch.log 200 ./train_gpt2cu -e out/init/model.bin "${order[@]}" "${hp[@]}" -s 0 -o out/ours_$name
            # DYN_EXTRA=0 leaves out PyTorch fp32 (the noise floor), when only the trainer against PyTorch bf16
            # is in question.
            variants=($name)
            step "torch 300 steps ($name) + compare" torch.log 300 python3 dev/train_gpt2_torch.py -e out/init/model.bin "${order[@]}" \
                "${hp[@]}" --compare out/ours_$name/log.jsonl --log out/dynamics/torch_$name.jsonl
            grep -E "PASS|FAIL" "$LOGS/torch.log" | tail -n 1 | sed "s/^/ours vs torch bf16 ($name): /" >>"$summary"
            if [ "${DYN_EXTRA:-1}" != 0 ]; then
                # The noise floor of this setting: PyTorch in fp32 (no autocast, no TF32) against its own bf16 run.
                step "torch fp32 300 steps ($name)" torch.log 300 python3 dev/train_gpt2_torch.py -e out/init/model.bin "${order[@]}" "${hp[@]}" \
                    --precision fp32 --compare out/dynamics/torch_$name.jsonl --log out/dynamics/torch_fp32_$name.jsonl
                grep -E "PASS|FAIL" "$LOGS/torch.log" | tail -n 1 | sed "s/^/torch fp32 vs torch bf16 ($name): /" >>"$summary"
            fi
            for v in "${variants[@]}"; do
                cp out/ours_$v/log.jsonl out/dynamics/ours_$v.jsonl
                grep -E '"val_loss"' out/ours_$v/log.jsonl | tail -n 1 | sed "s/^/ours ($v), last validation: /" >>"$summary"
            done
            tar czf "$LOGS/dynamics_$name.tgz" -C out dynamics ;;
        torch-throughput)
            # PyTorch's throughput at B=16 and B=64 with torch.compile, for the table in docs/performance.md
            # (run it together with the throughput section, so both see the same GPU state).
            for B in 16 64; do
                smi=()
                [ $B = 64 ] && smi=(smi_run smi_torch_b64.log)
                "${smi[@]}" step "torch d12 B=$B compiled" torch_throughput.log 300 python3 dev/train_gpt2_torch.py -e d12 -b $B -t 1024 -x 30 -v 0 --compile 1
                grep -E "^average|^peak" "$LOGS/torch_throughput.log" | tail -n 2 >>"$summary"
            done ;;
        attention-detail)
            # One d12 B=64 launch of each flash kernel in the trainer (the second step's first), with Nsight
            # Compute's throughput, occupancy, warp-stall and instruction sections, to see what bounds them.
            # The trainer runs the wgmma kernels on Hopper GPUs (flash90_*); elsewhere the mma.sync ones (flash_*).
            for k in ${ATTN_KERNELS:-flash90_fwd_kernel flash90_dkdv_kernel flash90_dq_kernel}; do
                step "ncu detail $k" attention_detail.log 150 ncu --target-processes application-only \
                    --kernel-name "regex:$k" --launch-skip 12 --launch-count 1 --section SpeedOfLight \
                    --section Occupancy --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
                    --section InstructionStats --section MemoryWorkloadAnalysis \
                    ./train_gpt2cu -e d12 -b 64 -t 1024 -x 2 -v 0 -s 0 -o ""
            done
            grep -E "flash|Duration|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Shared Memory Throughput|Bank|L2 Cache Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Stall|Memory Throughput" \
                "$LOGS/attention_detail.log" | tee -a "$summary" ;;
        profile)
            # Where a d12 B=64 step's time goes: every kernel of the second step under Nsight Compute at the
            # clocks it gets (one at a time, so without the two streams' overlap), summed by kernel.
            step "ncu d12 B=64 step" profile.log 300 ncu --target-processes application-only --clock-control none \
                --csv --print-units base --log-file "$LOGS/profile_ncu.csv" \
                --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,gpc__cycles_elapsed.avg.per_second \
                ./train_gpt2cu -e d12 -b 64 -t 1024 -x 2 -v 0 -s 0 -o ""
            python3 dev/ncu_step.py "$LOGS/profile_ncu.csv" --sequence 12 | tee -a "$summary" ;;
        compare)
            # Trainers built from other commits, timed against each other in one run:
            # COMPARE="new= old=HEAD~1 ..." (see dev/compare_builds.sh).
            # shellcheck disable=SC2086
            step compare_builds compare.log 550 bash dev/compare_builds.sh ${COMPARE:-base=}
            tail -n $(( $(echo ${COMPARE:-base=} | wc -w) + 2 )) "$LOGS/compare.log" >>"$summary" ;;
        quickstart)
            step quickstart quickstart.log 300 bash scripts/quickstart.sh
            grep -E "val loss|^step .*(/| 1500)" "$LOGS/quickstart.log" | tail -n 12 >>"$summary"
            tail -n 25 "$LOGS/quickstart.log" >>"$summary" ;;
        *) note "unknown section $section" ;;
    esac
done
echo
echo "==== summary"
cat "$summary"
