#!/usr/bin/env bash
# The project's GPU measurements in named sections, for any machine with an NVIDIA GPU: build, GPU tests,
# sanitizer, benchmarks, the trainer against PyTorch, kernel labs and profiles. Each section's log goes to
# $LOGS (default build/gpu-logs) and a summary (date, commit, GPU, then one line per step and the figures
# each section reports) is printed last and kept in $LOGS/summary.txt. docs/performance.md says which
# sections made which figures.
#   bash dev/gpu_runs.sh SECTION...
#   sections: build tests io-tests sanitizer bench-io dataloader tokenizer kernels trainer throughput
#             quickstart long-tests resume bench-checkpoint torch torch-mild torch-hot torch-throughput
#             attention-lab throughput-large profile profile-real attention-ncu attention-detail compare
#             matmul-lab matmul-sustain matmul-sustain-each gemm-tune-compare dw-stream-compare fp8-lab
#             fp8-throughput fp8-matmuls fp8-large fp8-loss-d12 fp8-loss-d24 llmc classifier-lab
#             classifier-detail classifier-stalls
#   e.g.  bash dev/gpu_runs.sh build throughput torch-throughput
# Environment: LOGS (log folder); TIME_BUDGET (seconds, default 0: none): when set, no step starts or runs
# past it, so a run under an outer time limit still prints its summary; BUILD_TARGETS (what `build` makes,
# default all); the per-section knobs named below (IO_SIZES, LARGE_BS, DYN_EXTRA, SUSTAIN_S, SUSTAIN_EACH_S,
# ATTN_KERNELS, COMPARE, FP8_SETS, FP8_MODES, CLASSIFIER_EXP, FP8_LOSS_MODES, FP8_LOSS_SPLIT, FP8_LOSS_ROUNDING_SEEDS,
# FP8_LOSS_PARALLEL, FP8_LOSS_EVAL, FP8_LOSS_LIMIT, LLMC_PEER, PROFILE_ARGS).
# Most sections need data/ from `make data`. The tokenizer section needs build/prepare_data (built where
# the PCRE2 headers are installed), .deps/gpt2 and data/corpus.
set -u
cd "$(dirname "$0")/.."
# The sections, as the case below names them: a misspelt one stops the script before anything runs.
sections="build tests io-tests sanitizer bench-io dataloader tokenizer kernels trainer throughput quickstart
          long-tests resume bench-checkpoint torch torch-mild torch-hot torch-throughput attention-lab
          throughput-large profile profile-real attention-ncu attention-detail compare matmul-lab matmul-sustain
          matmul-sustain-each gemm-tune-compare dw-stream-compare fp8-lab fp8-throughput fp8-matmuls fp8-large
          fp8-loss-d12 fp8-loss-d24 llmc classifier-lab classifier-detail classifier-stalls"
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
            step bench_device_file_io bench_io.log 500 ./build/bench_device_file_io --dir /tmp --sizes-gib "${IO_SIZES:-1,4}" --reps 3
            grep -E "target|peak extra" "$LOGS/bench_io.log" | tee -a "$summary" ;;
        dataloader)
            step test_dataloader_gpu tests.log 200 ./build/test_dataloader_gpu
            step bench_dataloader bench_dataloader.log 300 ./build/bench_dataloader
            tail -n 12 "$LOGS/bench_dataloader.log" >>"$summary" ;;
        tokenizer)
            step bench_tokenizer bench_tokenizer.log 300 python3 dev/bench_tokenizer.py --threads 16
            tail -n 8 "$LOGS/bench_tokenizer.log" >>"$summary" ;;
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
        fp8-throughput)
            # d12 T=1024 in bf16 and with the FP8 matmuls that pay (--fp8 1), B=64 (GPU clock and power sampled) and
            # B=16, interleaved, 2 rounds; each run's average over steps 2-30 and its peak memory. FP8_MODES:
            # the --fp8 values (default "0 1"); CLASSIFIER_EXP: the --classifier-exp values bf16 runs with
            # (default "0"; "0 1": both, interleaved; FP8 modes run with 0, since FP8 lm_head takes no other).
            for round in 1 2; do
                for B in 64 16; do
                    for fp8 in ${FP8_MODES:-0 1}; do
                        for cexp in ${CLASSIFIER_EXP:-0}; do
                            [ "$fp8" != 0 ] && [ "$cexp" != 0 ] && continue
                            smi=()
                            [ $B = 64 ] && smi=(smi_run "smi_fp8_${fp8}_c${cexp}_r$round.log")
                            "${smi[@]}" step "d12 B=$B --fp8 $fp8 --classifier-exp $cexp (round $round)" \
                                fp8_throughput.log 120 \
                                ./train_gpt2cu -e d12 -b $B -t 1024 -x 30 -v 0 -s 0 -o "" --fp8 $fp8 --classifier-exp $cexp
                            grep -E "^average|^peak" "$LOGS/fp8_throughput.log" | tail -n 2 >>"$summary"
                        done
                    done
                done
            done ;;
        fp8-matmuls)
            # Which FP8 matmuls pay: d12 B=64 with each one alone (and FP8_SETS, comma lists separated by spaces).
            for set in ${FP8_SETS:-0 qkv fc lm_head attproj.dx fcproj.dx lm_head,lm_head.grad 1}; do
                step "d12 B=64 --fp8 $set" fp8_matmuls.log 120 ./train_gpt2cu -e d12 -b 64 -t 1024 -x 30 -v 0 -s 0 -o "" --fp8 "$set"
                grep -E "^average" "$LOGS/fp8_matmuls.log" | tail -n 1 >>"$summary"
            done ;;
        fp8-large)
            # d24 and d48 at T=1024, the largest B of LARGE_BS that fits, in bf16 and FP8 (FP8_MODES: the --fp8
            # values, default "0 1"), with peak memory, and the SM clock and power of the run that fit.
            for model in d24 d48; do
                for fp8 in ${FP8_MODES:-0 1}; do
                    for B in ${LARGE_BS:-128 112 96 80 64 56 48 40 32 24 16 8 4}; do
                        smi_start
                        if step "$model B=$B --fp8 $fp8" fp8_large.log 150 \
                            ./train_gpt2cu -e $model -b $B -t 1024 -x 12 -v 0 -s 0 -o "" --fp8 $fp8; then
                            smi_stop
                            grep -E "^average|^peak" "$LOGS/fp8_large.log" | tail -n 2 >>"$summary"
                            smi_summary "smi_fp8_large_${model}_$(echo "$fp8" | tr -c 'a-z0-9\n' '_')"
                            break
                        fi
                        smi_stop
                        rm -f "$LOGS/smi.tmp"
                    done
                done
            done ;;
        fp8-loss-d12|fp8-loss-d24)
            # Training quality with FP8: the same run in bf16 and with --fp8 1 on the quick-start corpus
            # (data/quickstart_*), B=64 T=1024, the README's hyperparameters; d12 1000 steps, d24 500. The
            # logs go to $LOGS/fp8_loss_<model>_<mode>/; dev/compare_losses.py compares them from step 51.
            # FP8_LOSS_MODES: the --fp8 values to run (default "0 1"; 0 first, the others compared with it).
            # FP8_LOSS_SPLIT=1 also runs bf16 with each step in two micro-batches of 32 (-b 32 -d 65536: the
            # same arithmetic but for the order of the sums), the reference each comparison prints beside it.
            # FP8_LOSS_ROUNDING_SEEDS (e.g. "2 3"): bf16 again with each of these --rounding-seed values (the same
            # run but for the parameters' stochastic rounding), each compared with the bf16 run: the spread of
            # bf16 runs that differ in rounding alone, to read the FP8 runs' gaps against.
            # FP8_LOSS_PARALLEL=1 runs them all at once, side by side on the GPU (each run's numbers are the
            # same as alone: only its speed changes), under one time limit of 590 s for d12's 1000 steps
            # (FP8_LOSS_LIMIT) instead of 590 s each.
            # FP8_LOSS_EVAL=1 keeps each run's model (model.bin) and scores it on the first 40 batches of the
            # training shards in a bf16 forward and in the run's own: whether a gap is in the trained weights
            # or in how the FP8 forward measures the loss (docs/performance.md, "Worse weights, not a noisier
            # forward").
            model=${section#fp8-loss-}
            steps=1000
            [ "$model" = d24 ] && steps=500
            runs=(${FP8_LOSS_MODES:-0 1})
            [ "${FP8_LOSS_SPLIT:-0}" = 1 ] && runs+=(split)
            for seed in ${FP8_LOSS_ROUNDING_SEEDS:-}; do runs+=("rs$seed"); done
            save=none
            [ "${FP8_LOSS_EVAL:-0}" = 1 ] && save=llmc
            pids=()
            for run in "${runs[@]}"; do
                args=(-b 64 --fp8 "$run")
                [ "$run" = split ] && args=(-b 32 -d 65536 --fp8 0)
                [ "${run#rs}" != "$run" ] && args=(-b 64 --fp8 0 --rounding-seed "${run#rs}")
                train=(./train_gpt2cu -e $model -i 'data/quickstart_train_*.bin' -j 'data/quickstart_val_*.bin' -t 1024
                       -l 6e-4 -u 100 -k cosine -q 0.1 -c 0.1 -x $steps -v 100 -m 20 -s 0 --log-every 100
                       --save-model $save "${args[@]}" -o "$LOGS/fp8_loss_${model}_$run")
                if [ "${FP8_LOSS_PARALLEL:-0}" = 1 ]; then  # each run in its own log; the step lines below
                    step "$model $steps steps ${args[*]}" "fp8_loss_${model}_$run.log" "${FP8_LOSS_LIMIT:-590}" \
                        "${train[@]}" &
                    pids+=($!)
                else
                    smi_run "smi_fp8_loss_${model}_$run.log" step "$model $steps steps ${args[*]}" "fp8_loss_$model.log" \
                        "${FP8_LOSS_LIMIT:-590}" "${train[@]}"
                    grep -E "^average|^peak|val loss" "$LOGS/fp8_loss_$model.log" | tail -n 3 >>"$summary"
                fi
            done
            if [ ${#pids[@]} -gt 0 ]; then
                for pid in "${pids[@]}"; do wait "$pid"; done
                for run in "${runs[@]}"; do
                    echo "$run:" >>"$summary"
                    grep -E "^average|^peak|val loss" "$LOGS/fp8_loss_${model}_$run.log" | tail -n 3 >>"$summary"
                done
            fi
            if [ "$save" = llmc ]; then
                for run in "${runs[@]}"; do
                    forwards=(0)
                    [ "${run#rs}" = "$run" ] && [ "$run" != split ] && [ "$run" != 0 ] && forwards+=("$run")
                    for fwd in "${forwards[@]}"; do
                        step "$model $run's model, --fp8 $fwd" "fp8_loss_eval_$model.log" 120 ./train_gpt2cu \
                            -e "$LOGS/fp8_loss_${model}_$run/model.bin" -x 0 -j 'data/quickstart_train_*.bin' -b 64 \
                            -t 1024 -v 1 -m 40 -s 0 -o "" --fp8 "$fwd"
                        note "  the training shards' loss (40 batches): $(grep "val loss:" \
                            "$LOGS/fp8_loss_eval_$model.log" | tail -n 1)"
                    done
                done
            fi
            reference=()
            [ -f "$LOGS/fp8_loss_${model}_split/log.jsonl" ] &&
                reference=(--reference "$LOGS/fp8_loss_${model}_split/log.jsonl" --reference-label "bf16 2x32")
            for fp8 in ${FP8_LOSS_MODES:-0 1}; do
                [ "$fp8" = 0 ] || [ ! -f "$LOGS/fp8_loss_${model}_0/log.jsonl" ] ||
                    { echo "--fp8 $fp8 against bf16:"; python3 dev/compare_losses.py "$LOGS/fp8_loss_${model}_$fp8/log.jsonl" \
                        "$LOGS/fp8_loss_${model}_0/log.jsonl" --max-diff 0.03 --max-val-rel 0.01 --from-step 51 --windows 100 \
                        "${reference[@]}"; } | tee -a "$summary"
            done
            for seed in ${FP8_LOSS_ROUNDING_SEEDS:-}; do
                [ -f "$LOGS/fp8_loss_${model}_rs$seed/log.jsonl" ] && [ -f "$LOGS/fp8_loss_${model}_0/log.jsonl" ] &&
                    { echo "bf16 with --rounding-seed $seed against bf16:";
                      python3 dev/compare_losses.py "$LOGS/fp8_loss_${model}_rs$seed/log.jsonl" \
                          "$LOGS/fp8_loss_${model}_0/log.jsonl" --max-diff 0.03 --max-val-rel 0.01 --from-step 51 \
                          --windows 100; } | tee -a "$summary"
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
        profile)
            # Per-kernel GPU time of d12 B=64 T=1024 (3 steps under Nsight Compute, kernels serialised), from
            # the last step only: the first also runs the gemm tuner's trial matmuls. PROFILE_ARGS: more
            # trainer options (e.g. "--fp8 all").
            step "ncu d12 B=64 ${PROFILE_ARGS:-}" profile.log 500 ncu --target-processes application-only --csv \
                --print-units base --metrics gpu__time_duration.sum --log-file "$LOGS/ncu.csv" \
                ./train_gpt2cu -e d12 -b 64 -t 1024 -x 3 -v 0 -s 0 -o "" ${PROFILE_ARGS:-}
            python3 dev/ncu_summary.py "$LOGS/ncu.csv" --last-step adamw_kernel | tee -a "$summary" ;;
        profile-real)
            # The same per-kernel table with ncu leaving clocks and caches alone. The kernels still run one by
            # one with ncu's pauses between them, so the GPU draws less power and may hold higher clocks than
            # in a plain run (an H200 at d12 B=64 sits at its 700 W cap, ~1.5 GHz): the total is not the plain
            # run's kernel time. nvidia-smi samples the SM clock, power and clock-event reasons in a plain run.
            step "ncu d12 B=64 (real clocks)" profile_real.log 500 ncu --target-processes application-only --csv --print-units base \
                --clock-control none --cache-control none --metrics gpu__time_duration.sum --log-file "$LOGS/ncu_real.csv" \
                ./train_gpt2cu -e d12 -b 64 -t 1024 -x 3 -v 0 -s 0 -o ""
            python3 dev/ncu_summary.py "$LOGS/ncu_real.csv" --last-step adamw_kernel | tee -a "$summary"
            smi_run smi.log step "train_gpt2cu d12 B=64 (smi)" profile_real.log 120 ./train_gpt2cu -e d12 -b 64 -t 1024 -x 30 \
                -v 0 -s 0 -o ""
            tail -n 3 "$LOGS/profile_real.log" >>"$summary" ;;
        long-tests)
            step "test_gpt2_gpu T=1024" trainer.log 400 env LLMC_LONG_TESTS=1 ./build/test_gpt2_gpu --gtest_filter='*T_1024*' ;;
        resume)
            step test_resume.sh trainer.log 500 bash test/test_resume.sh ;;
        bench-checkpoint)
            step bench_checkpoint bench_checkpoint.log 300 ./build/bench_checkpoint /tmp/bench_checkpoint 3
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
            # Ours with the bf16 parameters rounded to nearest (as autocast does) against the same torch run:
            # what stochastic rounding contributes to the difference.
            step "ours 300 steps (hot, round to nearest)" torch.log 200 ./train_gpt2cu -e out/init/model.bin "${order[@]}" \
                "${hot[@]}" --stochastic-rounding 0 -s 0 -o out/ours_hot_rn
            cp out/ours_hot_rn/log.jsonl out/dynamics/ours_hot_rn.jsonl
            python3 dev/compare_losses.py out/dynamics/ours_hot_rn.jsonl out/dynamics/torch_hot.jsonl | tee -a "$LOGS/torch.log" |
                sed "s/^/ours round-to-nearest vs torch bf16 (hot): /" >>"$summary"
            tar czf "$LOGS/dynamics.tgz" -C out dynamics ;;
        torch-mild|torch-hot)
            # The training-dynamics check in one setting, quickly: ours with stochastic rounding (the default)
            # and with round to nearest, against one torch bf16 run, and torch fp32 against torch bf16. hot: the setting of the torch section
            # (B=16, lr 6e-4, 30 warmup steps); mild: the same at lr 3e-4. Logs in $LOGS/dynamics_NAME.tgz.
            name=${section#torch-}
            lr=6e-4
            [ "$name" = mild ] && lr=3e-4
            hp=(-b 16 -t 1024 -x 300 -l $lr -u 30 -q 0.1 -c 0.1 -k cosine -v 100 -m 10)
            order=(--shuffle 1 --seed 1337)
            mkdir -p out/dynamics
            [ -f out/init/model.bin ] || step "d12 init" torch.log 120 ./train_gpt2cu -e d12 -x 0 -v 0 -s 0 --save-model llmc -o out/init
            step "ours 300 steps ($name)" torch.log 200 ./train_gpt2cu -e out/init/model.bin "${order[@]}" "${hp[@]}" -s 0 -o out/ours_$name
            # DYN_EXTRA=0 leaves out ours with round to nearest and PyTorch fp32 (the noise floor), when only
            # the default trainer against PyTorch bf16 is in question.
            variants=($name)
            if [ "${DYN_EXTRA:-1}" != 0 ]; then
                variants+=(${name}_rn)
                step "ours 300 steps ($name, round to nearest)" torch.log 200 ./train_gpt2cu -e out/init/model.bin "${order[@]}" \
                    "${hp[@]}" --stochastic-rounding 0 -s 0 -o out/ours_${name}_rn
            fi
            step "torch 300 steps ($name)" torch.log 300 python3 dev/train_gpt2_torch.py -e out/init/model.bin "${order[@]}" "${hp[@]}" \
                --log out/dynamics/torch_$name.jsonl
            if [ "${DYN_EXTRA:-1}" != 0 ]; then
                # The noise floor of this setting: PyTorch in fp32 (no autocast, no TF32) against its own bf16 run.
                step "torch fp32 300 steps ($name)" torch.log 300 python3 dev/train_gpt2_torch.py -e out/init/model.bin "${order[@]}" "${hp[@]}" \
                    --precision fp32 --log out/dynamics/torch_fp32_$name.jsonl
                python3 dev/compare_losses.py out/dynamics/torch_fp32_$name.jsonl out/dynamics/torch_$name.jsonl | tee -a "$LOGS/torch.log" |
                    sed "s/^/torch fp32 vs torch bf16 ($name): /" >>"$summary"
            fi
            for v in "${variants[@]}"; do
                cp out/ours_$v/log.jsonl out/dynamics/ours_$v.jsonl
                python3 dev/compare_losses.py out/dynamics/ours_$v.jsonl out/dynamics/torch_$name.jsonl | tee -a "$LOGS/torch.log" |
                    sed "s/^/ours ($v) vs torch bf16 ($name): /" >>"$summary"
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
        matmul-sustain)
            # The step's matmuls alone, back to back for 20 s: their time at the clock the power cap leaves.
            smi_run smi_matmul.log step "matmul_lab --sustain" matmul_sustain.log 120 ./build/matmul_lab --sustain ${SUSTAIN_S:-20}
            tail -n 19 "$LOGS/matmul_sustain.log" >>"$summary" ;;
        matmul-sustain-each)
            # Every heuristic result of each matmul, each back to back for SUSTAIN_EACH_S seconds: the ranking
            # at the power cap (where energy per run decides speed) against the sweep's short bursts.
            smi_run smi_matmul_each.log step "matmul_lab --sustain-each" matmul_sustain_each.log 300 ./build/matmul_lab \
                --algos 8 --sustain-each ${SUSTAIN_EACH_S:-0.4}
            grep -E "rank 0 .* best rank|rank 0 skipped" "$LOGS/matmul_sustain_each.log" >>"$summary" ;;
        gemm-tune-compare)
            # The trainer with and without its gemm tuner (which picks by short timed bursts), interleaved.
            for r in 1 2 3; do
                for t in 1 0; do
                    step "train_gpt2cu --gemm-tune $t" gemm_tune.log 120 ./train_gpt2cu -e d12 -b 64 -t 1024 -x 30 -v 0 -s 0 \
                        -o "" --gemm-tune $t
                    echo "round $r --gemm-tune $t: $(grep '^average' "$LOGS/gemm_tune.log" | tail -n 1)" | tee -a "$summary"
                done
            done ;;
        dw-stream-compare)
            # Backward's weight gradients on one stream and on a second (levels 1 and 2) in one trainer,
            # interleaved (dev/compare_builds.sh: the losses and norms must be the same in every run).
            step "compare_builds --dw-stream 0 1 2" dw_stream.log 420 env ROUNDS=5 \
                ARGS="-e d12 -b 64 -t 1024 -x 40" bash dev/compare_builds.sh "dw0=./train_gpt2cu --dw-stream 0" \
                "dw1=./train_gpt2cu --dw-stream 1" "dw2=./train_gpt2cu --dw-stream 2"
            tail -n 6 "$LOGS/dw_stream.log" >>"$summary" ;;
        matmul-lab)
            # Every cuBLASLt algorithm the heuristic offers for each matmul of a d12 B=64 step, timed.
            step matmul_lab matmul_lab.log 200 ./build/matmul_lab
            tail -n 40 "$LOGS/matmul_lab.log" >>"$summary" ;;
        fp8-lab)
            # The forward matmuls of a d12 B=64 step with E4M3 operands against bf16, without and with fast
            # accumulation: speed, the casts' cost, and the error.
            step fp8_lab fp8_lab.log 120 ./build/fp8_lab
            step fp8_lab_fast fp8_lab.log 120 ./build/fp8_lab --fast-accum 1
            grep -A 12 "^matmul" "$LOGS/fp8_lab.log" >>"$summary" ;;
        classifier-lab)
            # Our Hopper classifier matmul (plain, and with the exp epilogue) against cuBLASLt and cuBLASLt +
            # fused_classifier at d12 B=64, after its checks against a double reference (needs sm_90a).
            step classifier_gemm_lab classifier_lab.log 180 ./build/classifier_gemm_lab
            grep -E "^(plain|exp|loss)|^variant|^cuBLASLt|^ours" "$LOGS/classifier_lab.log" >>"$summary" ;;
        attention-lab)
            step attention_lab attention.log 300 ./build/attention_lab
            tail -n 20 "$LOGS/attention.log" >>"$summary" ;;
        attention-ncu)
            # The lab's flash kernels under Nsight Compute, which holds the clocks fixed: median time per
            # launch of each variant (template arguments) and grid, free of clock drift between variants.
            step "ncu attention_lab" attention_ncu.log 400 ncu --target-processes application-only --csv --print-units base \
                --metrics gpu__time_duration.sum --kernel-name regex:flash --log-file "$LOGS/attention_ncu.csv" ./build/attention_lab
            python3 dev/ncu_summary.py "$LOGS/attention_ncu.csv" --variants | grep -E "kernel \||, (192|768), 1\)" |
                tee -a "$summary" ;;
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
        classifier-detail)
            # The Hopper classifier matmul's plain and exp kernels (the lab's first launch of each, d12 B=64) under
            # Nsight Compute: what the exp epilogue adds (the ex2 unit, issue slots, stalls) over the plain one.
            step "ncu detail classifier" classifier_detail.log 300 ncu --target-processes application-only \
                --kernel-name regex:cls_gemm_kernel --launch-count 2 --section SpeedOfLight --section LaunchStats \
                --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats \
                --section MemoryWorkloadAnalysis ./build/classifier_gemm_lab --reps 2 --rounds 2
            grep -E "cls_gemm|Duration|Compute \(SM\) Throughput|Registers Per|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Shared Memory Throughput|L2 Cache Throughput|DRAM Throughput|Stall|Memory Throughput|XU|Pipe" \
                "$LOGS/classifier_detail.log" | tee -a "$summary" ;;
        classifier-stalls)
            # Where the Hopper classifier's exp kernel waits, per SASS instruction (the lab's first exp launch,
            # d12 B=64): Nsight Compute's warp samples and stall reasons, summarised by dev/ncu_stalls.py.
            step "ncu stalls classifier" classifier_stalls.log 300 ncu --target-processes application-only \
                --kernel-name-base mangled --kernel-name regex:cls_gemm_kernelILb1E --launch-count 1 --set full \
                --import-source yes -f -o "$LOGS/classifier_stalls" ./build/classifier_gemm_lab --reps 1 --rounds 2 &&
                ncu -i "$LOGS/classifier_stalls.ncu-rep" --page source --csv --print-source sass \
                    >"$LOGS/classifier_stalls_sass.csv" &&
                python3 dev/ncu_stalls.py "$LOGS/classifier_stalls_sass.csv" --top 25 | tee -a "$summary" ;;
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
