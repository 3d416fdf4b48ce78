#!/usr/bin/env bash
# build/eval_mc and build/gpt2_cpu_dump on a tiny model and inputs written here (no GPU, no vocabulary):
#   - a result file (eval_mc --scores, gpt2_cpu_dump --out) whose write fails part way (a file size limit)
#     leaves the previous file as it was, not a half-written one, and the run exits 3;
#   - gpt2_cpu_dump's flags: --help prints the usage and exits 0; a malformed or missing value, an
#     unknown flag and --tokens without --out are usage errors (exit 2) naming the flag;
#   - eval_mc without --eval is one error line pointing to --help (exit 2), and a directory given as the
#     eval file is refused with the system's reason (exit 3); a model with a NaN weight is refused (exit 4).
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s build/eval_mc build/gpt2_cpu_dump
dir=$(mktemp -d /tmp/test_cpu_tools_output_XXXXXX)
trap 'rm -rf "$dir"' EXIT
source test/script_lib.sh

# A model (maxT 16, V 64, Vp 128, L 1, NH 2, C 8) of small random weights, an eval set of 40 items of 4
# endings over its vocabulary, and 3 batches of B=2 T=8 tokens for gpt2_cpu_dump.
python3 - "$dir" <<'PY'
import random, struct, sys
d = sys.argv[1]
rng = random.Random(1)
maxT, V, Vp, L, NH, C = 16, 64, 128, 1, 2, 8
sizes = [Vp * C, maxT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C, L * C, L * C,
         L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C]
params = []
for i, n in enumerate(sizes):
    if i in (2, 8, 14):
        params += [1.0] * n
    elif i == 0:
        params += [rng.gauss(0, 0.02) for _ in range(V * C)] + [0.0] * ((Vp - V) * C)
    else:
        params += [rng.gauss(0, 0.02) for _ in range(n)]
with open(f"{d}/model.bin", "wb") as f:
    f.write(struct.pack("<256i", 20240326, 3, maxT, V, L, NH, C, Vp, *([0] * 248)))
    f.write(struct.pack(f"<{len(params)}f", *params))
examples, longest = [], 0
for i in range(40):
    ctx = [rng.randrange(V) for _ in range(5)]
    ends = [[rng.randrange(V) for _ in range(3)] for _ in range(4)]
    body = [i, rng.randrange(4), 4, len(ctx)] + ctx + sum(([len(e)] + e for e in ends), [])
    size = 2 * (len(body) + 2)
    longest = max(longest, size)
    examples += [65535, size] + body
with open(f"{d}/set.bin", "wb") as f:
    f.write(struct.pack("<256i", 20240522, 1, 40, longest, *([0] * 252)))
    f.write(struct.pack(f"<{len(examples)}H", *examples))
B, T, n = 2, 8, 3
with open(f"{d}/tokens.bin", "wb") as f:
    f.write(struct.pack("<3i", B, T, n))
    f.write(struct.pack(f"<{n * 2 * B * T}i", *[rng.randrange(V) for _ in range(n * 2 * B * T)]))
PY

# limited_run FILE ARGS...: runs ARGS with files limited to 1 KiB (writes past it fail with EFBIG instead
# of killing the process); FILE holds a good earlier result that must survive the failed rewrite.
limited_run() {
    local file=$1 rc=0
    shift
    printf 'an earlier, complete result\n' >"$file"
    (trap '' XFSZ; ulimit -f 1; exec "$@") >"$dir/out" 2>&1 || rc=$?
    if [ $rc -ne 3 ] || ! grep -q "File too large" "$dir/out"; then
        echo "FAIL: $* exited $rc (expected 3, a failed write):"; cat "$dir/out"; exit 1
    fi
    if [ "$(cat "$file")" != "an earlier, complete result" ] || [ -e "$file.tmp" ]; then
        echo "FAIL: $* left $file half-written ($(wc -c <"$file") bytes) after a failed write"; exit 1
    fi
}

build/eval_mc --model "$dir/model.bin" --eval "$dir/set.bin" --scores "$dir/scores.tsv" >"$dir/out"
[ "$(grep -c '^pred' "$dir/scores.tsv")" = 40 ] || { echo "FAIL: eval_mc --scores wrote no 40 predictions"; exit 1; }
limited_run "$dir/scores.tsv" build/eval_mc --model "$dir/model.bin" --eval "$dir/set.bin" --scores "$dir/scores.tsv"

build/gpt2_cpu_dump --model "$dir/model.bin" --tokens "$dir/tokens.bin" --out "$dir/dump.bin" --steps 2 >"$dir/out"
[ "$(stat -c %s "$dir/dump.bin")" -gt 1024 ] || { echo "FAIL: gpt2_cpu_dump's dump is too small to test"; exit 1; }
limited_run "$dir/dump.bin" build/gpt2_cpu_dump --model "$dir/model.bin" --tokens "$dir/tokens.bin" \
    --out "$dir/dump.bin" --steps 2

expect_bin=(build/gpt2_cpu_dump)
expect_exit 0 "--write-version" --help
expect_exit 2 "--steps" --model "$dir/model.bin" --tokens "$dir/tokens.bin" --out "$dir/d.bin" --steps abc
expect_exit 2 "--lr" --model "$dir/model.bin" --tokens "$dir/tokens.bin" --out "$dir/d.bin" --lr 1e-3x
expect_exit 2 "--clip" --model "$dir/model.bin" --clip
expect_exit 2 "--bogus" --model "$dir/model.bin" --bogus 1
expect_exit 2 "--out" --model "$dir/model.bin" --tokens "$dir/tokens.bin"
expect_exit 2 "--model" --tokens "$dir/tokens.bin" --out "$dir/d.bin"
[ ! -e "$dir/d.bin" ] || { echo "FAIL: a refused command line wrote $dir/d.bin"; exit 1; }
expect_bin=(build/eval_mc)
expect_exit 2 "^error: --model and --eval are needed (see eval_mc --help)$" --model "$dir/model.bin"
[ "$(wc -l <"$dir/out")" = 1 ] || { echo "FAIL: eval_mc printed more than the error:"; cat "$dir/out"; exit 1; }
expect_exit 3 "^error: cannot open '$dir' for reading: Is a directory$" --model "$dir/model.bin" --eval "$dir"
# A NaN weight: the model is refused (exit 4, the tensor named), not scored to a nan accuracy.
python3 - "$dir" <<'PY'
import struct, sys
d = sys.argv[1]
b = bytearray(open(d + "/model.bin", "rb").read())
b[1024 + 4 * 5:1024 + 4 * 6] = struct.pack("<f", float("nan"))
open(d + "/nan.bin", "wb").write(b)
PY
expect_exit 4 "^error: model file '$dir/nan.bin': 1 parameter is not finite (NaN or infinity): 1 in tensor wte" \
    --model "$dir/nan.bin" --eval "$dir/set.bin"
echo "eval_mc and gpt2_cpu_dump: result files replaced whole or not at all; their command-line errors checked"
