#!/usr/bin/env bash
# scripts/plot.py on realistic log.jsonl files in train_gpt2cu's exact line format: a run with validation,
# multiple-choice eval lines, a resume (steps beyond it redone), a null norm and a line cut short by a
# kill, overlaid with a second run that logs tokens but no eval. Checked: the PNG's size (IHDR), the
# panel titles and the empty panels stored in its Description chunk, that each run's colour is drawn,
# that a lone run without eval lines leaves that panel empty, that the resume dropped the redone
# steps, and the errors (missing log: exit 3, label count: exit 2). Exit 0 pass, 1 fail, 77 skip.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! /usr/bin/python3 -c "import matplotlib, numpy" 2>/dev/null; then
    echo "skipped: /usr/bin/python3 cannot import matplotlib (apt-get install python3-matplotlib)"
    exit 77
fi
dir=$(mktemp -d /tmp/test_plot_XXXXXX)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/d6_lr3e-4" "$dir/d6_lr1e-3"

/usr/bin/python3 - "$dir" <<'PY'
import math, random, sys
d = sys.argv[1]
def step_line(s, loss, lr, norm, ms, tps, extra=""):
    n = "null" if norm is None else "%.9g" % norm
    return ('{"step":%d,"loss":%.17g,"lr":%.6g,"norm":%s,"ms":%.3f,"tok_per_s":%.1f,"mfu":%.4f%s}'
            % (s, loss, lr, n, ms, tps, 0.31 + 0.01 * math.sin(s), extra))
def eval_line(s, acc, acc_norm):
    return '{"step":%d,"eval_acc":%.6f,"eval_acc_norm":%.6f,"eval_items":10042}' % (s, acc, acc_norm)
rng = random.Random(1)
lines = []
for s in range(1, 61):
    lines.append(step_line(s, 10.9 * math.exp(-s / 40) + 3 + 0.1 * rng.random(), 3e-4 * min(1, s / 10),
                           None if s == 7 else 1.5 / math.sqrt(s), 86.5, 605000.0 + rng.random()))
    if s % 20 == 0:
        lines.append('{"step":%d,"val_loss":%.9g}' % (s, 10 * math.exp(-s / 40) + 3.2))
        lines.append(eval_line(s, 0.25 + s / 2000, 0.26 + s / 1800))
lines.append('{"resume_from_step":40}')
for s in range(41, 101):
    lines.append(step_line(s, 10.9 * math.exp(-s / 40) + 2.9, 3e-4, 1.0 / math.sqrt(s), 86.1, 606000.0))
    if s % 20 == 0:
        lines.append('{"step":%d,"val_loss":%.9g}' % (s, 10 * math.exp(-s / 40) + 3.1))
        lines.append(eval_line(s, 0.25 + s / 1500, 0.26 + s / 1400))
open(d + "/d6_lr3e-4/log.jsonl", "w").write("\n".join(lines) + '\n{"step":101,"loss":3.0')
lines = []
for s in range(1, 81):
    lines.append(step_line(s, 10.9 * math.exp(-s / 25) + 3.1, 1e-3, 2.0 / math.sqrt(s), 90.0, 580000.0,
                           ',"tokens":%d' % (s * 524288)))
    if s % 40 == 0:
        lines.append('{"step":%d,"val_loss":%.9g}' % (s, 10 * math.exp(-s / 25) + 3.3))
open(d + "/d6_lr1e-3/log.jsonl", "w").write("\n".join(lines) + "\n")
PY

/usr/bin/python3 scripts/plot.py "$dir/d6_lr3e-4" "$dir/d6_lr1e-3/log.jsonl" -o "$dir/both.png" --smooth 5 \
    --baseline-acc 0.294 --title "two runs" | tee "$dir/out"
/usr/bin/python3 scripts/plot.py "$dir/d6_lr1e-3" -o "$dir/one.png" --labels only | tee -a "$dir/out"
grep -q "d6_lr3e-4: last step 100, best val loss" "$dir/out" || { echo "FAIL: no summary line for the first run"; exit 1; }
grep -q "only: last step 80, best val loss" "$dir/out" || { echo "FAIL: --labels not used"; exit 1; }

/usr/bin/python3 - "$dir" <<'PY'
import math, struct, sys, zlib
import numpy as np
import matplotlib.image
sys.path.insert(0, "scripts")
import plot
d = sys.argv[1]
failures = []
def check(what, ok):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)

def png_info(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path + " is not a PNG"
    pos, size, text = 8, None, {}
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"tEXt":
            k, v = body.split(b"\0", 1)
            text[k.decode()] = v.decode("latin-1")
        elif kind == b"zTXt":
            k, rest = body.split(b"\0", 1)
            text[k.decode()] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            k, rest = body.split(b"\0", 1)
            text[k.decode()] = rest[2:].split(b"\0", 2)[2].decode()
        pos += 12 + n
    return size, text

def color_pixels(path, hex_color):
    img = matplotlib.image.imread(path)[..., :3]
    rgb = np.array([int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img - rgb).sum(axis=2) < 0.12).sum())

size, text = png_info(d + "/both.png")
check(f"both.png is 1200x1200 (got {size})", size == (1200, 1200))
desc = text.get("Description", "")
check("both.png lists its panels: " + desc, desc.startswith(
    "panels: loss | loss vs tokens | learning rate | gradient norm | throughput (tokens/s) | eval accuracy; empty: none"))
for name, hex_color in (("first run (C0)", "#1f77b4"), ("second run (C1)", "#ff7f0e")):
    n = color_pixels(d + "/both.png", hex_color)
    check(f"both.png draws the {name}: {n} pixels of its colour", n > 500)

size, text = png_info(d + "/one.png")
check(f"one.png is 1200x1200 (got {size})", size == (1200, 1200))
check("one.png: the eval panel is empty for a run without eval lines",
      text.get("Description", "").endswith("; empty: eval accuracy"))
check("one.png has no second run colour", color_pixels(d + "/one.png", "#ff7f0e") < 50)

run = plot.read_run(d + "/d6_lr3e-4/log.jsonl", "a")
steps = [s for s, _ in run.get("loss")]
check("the resume leaves steps 1..100 once each", steps == list(range(1, 101)))
check("steps after the resume come from the resumed run",
      abs(run.get("loss")[49][1] - (10.9 * math.exp(-50 / 40) + 2.9)) < 1e-12)
check("the null norm is skipped", [s for s, _ in run.get("norm")][:8] == [1, 2, 3, 4, 5, 6, 8, 9])
check("the validation and eval lines after step 40 are the resumed run's",
      [s for s, _ in run.get("val_loss")] == [20, 40, 60, 80, 100] and run.get("eval_acc")[2][1] == 0.25 + 60 / 1500)
check("the cut-short last line is counted as skipped", run.skipped == 1)
sys.exit(1 if failures else 0)
PY

rc=0; /usr/bin/python3 scripts/plot.py "$dir/none" -o "$dir/x.png" >"$dir/err" 2>&1 || rc=$?
[ $rc -eq 3 ] && grep -q "no such log" "$dir/err" || { echo "FAIL: a missing log gave exit $rc:"; cat "$dir/err"; exit 1; }
rc=0; /usr/bin/python3 scripts/plot.py "$dir/d6_lr1e-3" --labels a,b -o "$dir/x.png" >"$dir/err" 2>&1 || rc=$?
[ $rc -eq 2 ] && grep -q "gives 2 labels for 1 runs" "$dir/err" ||
    { echo "FAIL: a label count mismatch gave exit $rc:"; cat "$dir/err"; exit 1; }
[ ! -e "$dir/x.png" ] || { echo "FAIL: an error still wrote a PNG"; exit 1; }
# A resume line whose step is not a number (a damaged log) is skipped like any other bad line.
printf '{"step":1,"loss":5.5}\n{"resume_from_step":null}\n{"resume_from_step":"3"}\n{"step":2,"loss":5.25}\n' >"$dir/bad.jsonl"
rc=0; /usr/bin/python3 scripts/plot.py "$dir/bad.jsonl" -o "$dir/bad.png" >"$dir/err" 2>&1 || rc=$?
[ $rc -eq 0 ] && grep -q "skipped 2 line(s)" "$dir/err" && grep -q "last step 2" "$dir/err" ||
    { echo "FAIL: resume lines without a step number gave exit $rc:"; cat "$dir/err"; exit 1; }
# A run that trained nothing (-x 0) appends its records after an evaluation_of line: they are not the
# training run's (its step-0 validation loss and sample are left out of the curves), until a resume line.
printf '%s\n' '{"step":1,"loss":5.5}' '{"step":2,"loss":5.25}' '{"step":2,"val_loss":5.4}' \
    '{"evaluation_of":"out/model.bin"}' '{"step":0,"val_loss":9.9}' '{"step":0,"sample":[1,2]}' \
    '{"resume_from_step":2}' '{"step":3,"loss":5.0}' >"$dir/eval.jsonl"
/usr/bin/python3 - "$dir/eval.jsonl" <<'PY' || exit 1
import importlib.util, sys
spec = importlib.util.spec_from_file_location("plot", "scripts/plot.py")
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)
run = plot.read_run(sys.argv[1], "a")
if run.get("val_loss") != [(2, 5.4)] or [s for s, _ in run.get("loss")] != [1, 2, 3] or run.skipped:
    print("FAIL: the -x 0 run's records after evaluation_of must be left out: %r %r (skipped %d)"
          % (run.get("val_loss"), run.get("loss"), run.skipped)); sys.exit(1)
PY
echo "ok"
