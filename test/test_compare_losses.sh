#!/usr/bin/env bash
# dev/compare_losses.py, the per-step loss comparison behind the FP8 and PyTorch quality checks, on
# synthetic log.jsonl files in train_gpt2cu's line format: PASS (exit 0) when every compared step is within
# --max-diff and the final validation losses within --max-val-rel, FAIL (exit 1) otherwise; --from-step
# leaves the earlier steps out (a large early gap then passes); a step of the second log missing from the
# first fails; a NaN or null loss (either log, train or val) fails; a line cut short by a killed run is
# skipped with a note; the reported maximum, its step and the mean difference are the ones planted; --reference
# prints a third log's comparison without changing the verdict; --windows prints each window's mean, max
# and steps over the limit (the planted gap in its window); a log with fp8_outgrown counts gets their
# total, steps and first step; --plot writes a PNG (with a reference). Exit 0 pass, 1 fail, 77 skip (no matplotlib for the plot).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d /tmp/test_compare_losses_XXXXXX)
trap 'rm -rf "$dir"' EXIT

python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def write(name, offsets, val, skip=()):
    with open(f"{d}/{name}.jsonl", "w") as f:
        for s in range(1, 101):
            if s in skip:
                continue
            f.write(json.dumps({"step": s, "loss": 5.0 - 0.01 * s + offsets.get(s, 0.0), "lr": 1e-3, "norm": 1.0}) + "\n")
            if s % 50 == 0:
                f.write(json.dumps({"step": s, "val_loss": val if s == 100 else 6.0}) + "\n")
write("base", {}, 6.0)
write("close", {s: 0.01 for s in range(1, 101)}, 6.03)          # +0.01 everywhere, val +0.5%
write("early", {**{s: 0.01 for s in range(1, 101)}, 20: 0.2}, 6.03)  # one big gap at step 20
write("late", {**{s: 0.01 for s in range(1, 101)}, 70: -0.05}, 6.03) # a gap after step 50
write("valoff", {}, 6.1)                                        # val 1.7% off
write("missing", {}, 6.0, skip=(33,))
write("diverged", {s: float("nan") for s in range(60, 101)}, 6.0)  # NaN from step 60 (Python's json writes NaN)
write("nullval", {}, float("nan"))                               # a NaN final validation loss
# The trainer writes a loss it could not compute as null, and a run killed mid-line leaves a partial
# record that a resumed run follows with its own lines.
lines = open(f"{d}/base.jsonl").read().splitlines(keepends=True)
with open(f"{d}/nulls.jsonl", "w") as f:
    f.writelines(l.split('"loss"')[0] + '"loss": null}\n' if l.startswith('{"step": 40, "loss"') else l for l in lines)
# A run that trained nothing (-x 0) appended after an evaluation_of line: its step-0 validation loss is
# not the training run's (the first log's final one, 6.0, is what counts).
with open(f"{d}/evaluated.jsonl", "w") as f:
    f.writelines(lines)
    f.write('{"evaluation_of": "out/model.bin"}\n{"step": 0, "val_loss": 9.0}\n{"step": 100, "val_loss": 9.0}\n')
# train_gpt2cu with FP8 delayed scaling counts the tensors that outgrew their history in each step record.
with open(f"{d}/outgrown.jsonl", "w") as f:
    for l in lines:
        r = json.loads(l)
        if "loss" in r:
            r["fp8_outgrown"] = 3 if r["step"] in (12, 40) else 0
        f.write(json.dumps(r) + "\n")
with open(f"{d}/killed.jsonl", "w") as f:
    f.writelines(lines[:80])
    f.write('{"step": 79, "lo\n{"resume_from_step": 75}\n')
    f.writelines(lines[80:])
PY

run() {  # run EXPECTED_EXIT NAME ARGS...
    local want=$1 name=$2 rc=0
    shift 2
    python3 dev/compare_losses.py "$@" >"$dir/$name.out" 2>&1 || rc=$?
    if [ "$rc" != "$want" ]; then echo "FAIL: $name: exit $rc, expected $want"; cat "$dir/$name.out"; exit 1; fi
}
expect_out() {  # expect_out NAME TEXT
    grep -qF -- "$2" "$dir/$1.out" || { echo "FAIL: $1: no '$2' in:"; cat "$dir/$1.out"; exit 1; }
}
run 0 close "$dir/close.jsonl" "$dir/base.jsonl" --max-diff 0.03 --max-val-rel 0.01
expect_out close "max 0.0100"
expect_out close "mean +0.0100"
expect_out close "PASS"
run 1 early "$dir/early.jsonl" "$dir/base.jsonl" --max-diff 0.03
expect_out early "max 0.2000 at step 20"
expect_out early "FAIL"
run 0 early_from "$dir/early.jsonl" "$dir/base.jsonl" --max-diff 0.03 --from-step 51
expect_out early_from "over 50/50 steps from step 51"
run 1 late_from "$dir/late.jsonl" "$dir/base.jsonl" --max-diff 0.03 --from-step 51
expect_out late_from "max 0.0500 at step 70"
run 1 valoff "$dir/valoff.jsonl" "$dir/base.jsonl" --max-diff 0.03 --max-val-rel 0.01
expect_out valoff "val loss at step 100: 6.100000 vs 6.000000"
run 1 missing "$dir/missing.jsonl" "$dir/base.jsonl" --max-diff 0.03
expect_out missing "over 99/100 steps"
run 0 reference "$dir/close.jsonl" "$dir/base.jsonl" --max-diff 0.03 --reference "$dir/early.jsonl" --reference-label split
expect_out reference "split: per-step |loss difference|: max 0.2000 at step 20"
expect_out reference "(limit 0.03, 1 steps over it)"
expect_out reference "rel diff 5.00e-03 (limit 0.01) PASS"
run 1 windows "$dir/late.jsonl" "$dir/base.jsonl" --max-diff 0.03 --from-step 31 --windows 25
expect_out windows "  steps 31-50: mean +0.0100, max 0.0100, 0 of 20 over 0.03"
expect_out windows "  steps 51-75: mean +0.0076, max 0.0500, 1 of 25 over 0.03"
expect_out windows "  steps 76-100: mean +0.0100, max 0.0100, 0 of 25 over 0.03"
run 1 nolog "$dir/absent.jsonl" "$dir/base.jsonl"
expect_out nolog "no such log: $dir/absent.jsonl"
run 0 evaluated "$dir/evaluated.jsonl" "$dir/base.jsonl" --max-diff 0.03 --max-val-rel 0.01
expect_out evaluated "val loss at step 100: 6.000000 vs 6.000000"
run 0 outgrown "$dir/outgrown.jsonl" "$dir/base.jsonl" --max-diff 0.03
expect_out outgrown "outgrown.jsonl: FP8 tensors past their amax history (fp8_outgrown): 6 in 2 steps, the first at step 12"
! grep -q "base.jsonl: FP8" "$dir/outgrown.out" || { echo "FAIL: a log without fp8_outgrown got an outgrown line"; exit 1; }
# A loss that is NaN or null is a difference no limit accepts: FAIL, the first such step named as the worst.
run 1 diverged "$dir/diverged.jsonl" "$dir/base.jsonl" --max-diff 0.03
expect_out diverged "max nan at step 60"
expect_out diverged "(limit 0.03, 41 steps over it)"
run 1 diverged_second "$dir/base.jsonl" "$dir/diverged.jsonl" --max-diff 0.03 --windows 50
expect_out diverged_second "  steps 51-100: mean +nan, max nan, 41 of 50 over 0.03"
run 1 nulls "$dir/nulls.jsonl" "$dir/base.jsonl" --max-diff 0.03
expect_out nulls "max nan at step 40"
run 1 nullval "$dir/nullval.jsonl" "$dir/base.jsonl" --max-diff 0.03
expect_out nullval "val loss at step 100: nan vs 6.000000"
# A line cut short by a killed run is skipped with a note; the resume record is not one to note.
run 0 killed "$dir/killed.jsonl" "$dir/base.jsonl" --max-diff 0.03
expect_out killed "max 0.0000 at step 1"
expect_out killed "note: $dir/killed.jsonl: skipped 1 line(s) that are not log records"
echo "PASS/FAIL, --from-step, missing steps, NaN and null losses, cut lines, --reference, --windows: ok"

if ! /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
    echo "skipped: /usr/bin/python3 cannot import matplotlib (the --plot check)"
    exit 77
fi
rc=0
/usr/bin/python3 dev/compare_losses.py "$dir/late.jsonl" "$dir/base.jsonl" --max-diff 0.03 --from-step 51 \
    --plot "$dir/diff.png" --labels late,base --reference "$dir/close.jsonl" >"$dir/plot.out" 2>&1 || rc=$?
[ $rc = 1 ] || { echo "FAIL: --plot changed the exit code ($rc)"; cat "$dir/plot.out"; exit 1; }
head -c 8 "$dir/diff.png" | od -An -c | grep -q "P   N   G" || { echo "FAIL: --plot wrote no PNG"; cat "$dir/plot.out"; exit 1; }
echo "--plot: ok"
echo "ok"
