#!/usr/bin/env bash
# A numerics change judged as the field judges one: against the spread of the reference's own runs, on data
# read once. Each arm trains once per seed (--seed and --rounding-seed: the initialisation, the data order and
# the rounding all differ between runs of an arm; a seed S/R keeps the initialisation and data order of S and
# rounds with R, so runs differ in rounding alone), from scratch, on a corpus at least as long as the run
# (scripts/prepare_code_corpus.sh makes one). The arm "ref" is the trainer as it is, and always runs; another
# arm is NAME:FLAG=VALUE:... (the trainer with those flags added, e.g. "gelu:-r=1") or NAME@PATH (another
# build of the trainer). Then, per run, the final validation loss and the mean training loss of the last 100
# steps; per arm their mean and range; and the verdict, for both figures: |mean(arm) - mean(ref)| <=
# max(ref's range, 0.3% of ref's mean), and every run of the arm within 0.5% of ref's mean.
#   ARMS="ref gelu:-r=1" SEEDS="1 2 3 4" MODEL=d12 STEPS=600 bash dev/spread.sh
# Environment: ARMS (default "ref"), SEEDS ("1 2"), MODEL (d12), STEPS (600), B (64), T (1024), TRAIN / VAL
# (data/code_train_*.bin, data/code_val_*.bin), PARALLEL (runs at once on the GPU, 2: each run's numbers are
# the same as alone), LOGS (build/spread; a run whose log there reached STEPS' validation is kept, not
# repeated, so a sweep can be finished in parts), PLOT (a PNG of each arm's mean validation curve with its
# range as a band; none when empty), TRAINER (./train_gpt2cu, the reference), RUN (1; 0: train nothing,
# only report on the finished runs in LOGS, e.g. runs made on several machines).
# The hyperparameters are GPT-2 124M's (lr 6e-4, 50 warmup steps, cosine to 10%, weight decay 0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
ARMS=${ARMS:-ref}; SEEDS=${SEEDS:-1 2}; MODEL=${MODEL:-d12}; STEPS=${STEPS:-600}; B=${B:-64}; T=${T:-1024}
TRAIN=${TRAIN:-data/code_train_*.bin}; VAL=${VAL:-data/code_val_*.bin}; PARALLEL=${PARALLEL:-2}
LOGS=${LOGS:-build/spread}; PLOT=${PLOT:-}; TRAINER=${TRAINER:-./train_gpt2cu}; RUN=${RUN:-1}
die() { echo "spread: error: $*" >&2; exit 2; }
case " $ARMS " in *" ref "*) ;; *) ARMS="ref $ARMS" ;; esac
for arm in $ARMS; do [[ "$arm" =~ ^[A-Za-z0-9_.-]+([:@].*)?$ ]] || die "an arm is ref, NAME:FLAG=VALUE... or NAME@PATH, not '$arm'"; done
for v in STEPS B T PARALLEL; do [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "$v must be a positive integer, not '${!v}'"; done
if [ "$RUN" = 1 ]; then
[ -x "$TRAINER" ] || die "no trainer at $TRAINER (make train_gpt2cu)"
# The run must not read a token twice: the training shards' token counts (header[2]) against STEPS x B x T.
python3 - "$STEPS" "$B" "$T" $TRAIN <<'PY' || exit 2
import struct, sys
steps, b, t, files = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
have = sum(struct.unpack("<3i", open(f, "rb").read(12))[2] for f in files if not f.endswith("*.bin"))
if have < steps * b * t:
    sys.exit("spread: error: the training shards hold %d tokens, fewer than the %d that %d steps of %d x %d read: "
             "the data would repeat (scripts/prepare_code_corpus.sh MB makes more)" % (have, steps * b * t, steps, b, t))
PY
mkdir -p "$LOGS"
args=(-e "$MODEL" -b "$B" -t "$T" -x "$STEPS" -l 6e-4 -u 50 -q 0.1 -c 0.1 -v 100 -m -1 -s 0 -g 0
      --save-model none -i "$TRAIN" -j "$VAL")
runs=()
for seed in $SEEDS; do
    [[ "$seed" =~ ^[0-9]+(/[0-9]+)?$ ]] || die "a seed is S or S/R (non-negative integers), not '$seed'"
done
for arm in $ARMS; do for seed in $SEEDS; do runs+=("$arm|$seed"); done; done
running=0
for r in "${runs[@]}"; do
    arm=${r%|*} seed=${r#*|}
    rseed=${seed#*/} seed=${seed%%/*}
    name=${arm%%[:@]*} trainer=$TRAINER flags=()
    if [[ "$arm" == *@* ]]; then trainer=${arm#*@}; [ -x "$trainer" ] || die "arm $name: no trainer at $trainer"
    elif [[ "$arm" == *:* ]]; then
        IFS=: read -r -a parts <<<"${arm#*:}"
        for f in "${parts[@]}"; do flags+=("${f%%=*}" "${f#*=}"); done
    fi
    out="$LOGS/${name}_seed$seed$([ "$rseed" = "$seed" ] || echo "r$rseed")"
    if [ -f "$out/log.jsonl" ] && grep -Eq "^\\{\"step\": ?$STEPS, ?\"val_loss\"" "$out/log.jsonl"; then
        echo "spread: $name --seed $seed --rounding-seed $rseed: finished earlier ($out), kept"; continue
    fi
    rm -rf "$out"
    echo "spread: $name: $trainer ${flags[*]} --seed $seed --rounding-seed $rseed -> $out"
    "$trainer" "${args[@]}" "${flags[@]}" --seed "$seed" --rounding-seed "$rseed" -o "$out" \
        >"$out.txt" 2>&1 &
    running=$((running + 1))
    if [ $running -ge "$PARALLEL" ]; then wait -n || die "a run failed (its output: $LOGS/*.txt)"; running=$((running - 1)); fi
done
while [ $running -gt 0 ]; do wait -n || die "a run failed (its output: $LOGS/*.txt)"; running=$((running - 1)); done
fi
python3 - "$LOGS" "$PLOT" $(for a in $ARMS; do echo "${a%%[:@]*}"; done) <<'PY'
import json, os, statistics as st, sys
logs, plot, arms = sys.argv[1], sys.argv[2], sys.argv[3:]
runs = {}
for name in sorted(os.listdir(logs)):
    path = os.path.join(logs, name, "log.jsonl")
    if not os.path.isfile(path):
        continue
    arm, seed = name.rsplit("_seed", 1)
    train, val = {}, {}
    for line in open(path):
        j = json.loads(line)
        if "val_loss" in j: val[j["step"]] = j["val_loss"]
        elif "loss" in j: train[j["step"]] = j["loss"]
    last = max(train)
    runs.setdefault(arm, []).append(
        (seed.replace("r", "/"), val[max(val)], st.mean(train[s] for s in train if s > last - 100), val))
ref = runs["ref"]
def verdict(rows, k):
    mean, ref_mean = st.mean(r[k] for r in rows), st.mean(r[k] for r in ref)
    ref_range = max(r[k] for r in ref) - min(r[k] for r in ref)
    bound = max(ref_range, 0.003 * ref_mean)
    ok = abs(mean - ref_mean) <= bound and all(abs(r[k] - ref_mean) <= 0.005 * ref_mean for r in rows)
    return mean, max(r[k] for r in rows) - min(r[k] for r in rows), 100 * (mean / ref_mean - 1), ok
print("%-26s %-5s %-10s %-10s" % ("arm", "seed", "final val", "last 100"))
for arm in arms:
    for seed, v, t, _ in sorted(runs[arm], key=lambda r: [int(x) for x in r[0].split("/")]):
        print("%-26s %-5s %-10.4f %-10.4f" % (arm, seed, v, t))
print("\n%-26s %-34s %-34s %s" % ("arm", "final val: mean, range, vs ref", "last 100: mean, range, vs ref", "verdict"))
for arm in arms:
    v, t = verdict(runs[arm], 1), verdict(runs[arm], 2)
    print("%-26s %.4f  %.4f  %+.2f%%              %.4f  %.4f  %+.2f%%              %s" % (
        arm, v[0], v[1], v[2], t[0], t[1], t[2], "reference" if arm == "ref" else "pass" if v[3] and t[3] else "fail"))
# The run clause on ref's own runs, and each arm against ref paired by seed (the same initialisation and
# data order), tell what the spread is made of.
for k, what in ((1, "final val"), (2, "last 100")):
    m = st.mean(r[k] for r in ref)
    print("ref's own runs within 0.5%% of their mean (%s): %d of %d" % (what, sum(abs(r[k] - m) <= 0.005 * m for r in ref), len(ref)))
by_seed = {r[0]: r for r in ref}
for arm in arms[1:]:
    d = [100 * (r[1] / by_seed[r[0]][1] - 1) for r in runs[arm] if r[0] in by_seed]
    if d:
        print("%-26s against ref's run of the same seed (final val): mean %+.2f%%, from %+.2f%% to %+.2f%% (%d seeds)"
              % (arm, st.mean(d), min(d), max(d), len(d)))
if plot:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(11, 4.5))
    ref_steps = sorted(set.intersection(*(set(r[3]) for r in ref)))
    ref_mean = {s: st.mean(r[3][s] for r in ref) for s in ref_steps}
    for arm in arms:
        steps = sorted(set.intersection(*(set(r[3]) for r in runs[arm])))
        steps = [s for s in steps if s >= 200 and s in ref_mean]
        curves = [[r[3][s] for s in steps] for r in runs[arm]]
        label = "%s (%d runs)" % (arm, len(curves))
        ax.plot(steps, [st.mean(c) for c in zip(*curves)], label=label)
        ax.fill_between(steps, [min(c) for c in zip(*curves)], [max(c) for c in zip(*curves)], alpha=0.2)
        pct = [[100 * (v / ref_mean[s] - 1) for v, s in zip(c, steps)] for c in curves]
        rel.plot(steps, [st.mean(c) for c in zip(*pct)], label=label)
        rel.fill_between(steps, [min(c) for c in zip(*pct)], [max(c) for c in zip(*pct)], alpha=0.2)
    ax.set_xlabel("step"); ax.set_ylabel("validation loss"); ax.legend(); ax.grid(alpha=0.3)
    rel.set_xlabel("step"); rel.set_ylabel("validation loss vs ref's mean (%)"); rel.grid(alpha=0.3)
    rel.set_title("mean and range of each arm's runs", fontsize=10)
    fig.tight_layout(); fig.savefig(plot, dpi=110)
    print("plot: %s" % plot)
PY
