#!/usr/bin/env bash
# build/inspect_checkpoint on checkpoints written here byte by byte (a manifest with its chunk and end
# checksums, computed by an independent Python copy of llmc/hash.h's checksum64), no GPU needed:
#   - a whole checkpoint with finite values passes (exit 0), alone and with --all;
#   - -q prints one line per checkpoint, for checkpoints named as for those found with --all;
#   - a non-finite value, a flipped byte and a truncated file each fail with exit 4 naming the file;
#   - --all on a directory that does not exist (exit 3) or holds no checkpoint (exit 4) fails naming it,
#     rather than report "0 checkpoint(s) whole" with success, which would let a mistyped directory or a
#     run that never saved pass a check.
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s build/inspect_checkpoint
dir=$(mktemp -d /tmp/test_inspect_checkpoint_XXXXXX)
trap 'rm -rf "$dir"' EXIT

# write_checkpoint OUT STEP VALUES...: OUT/ckpt_<STEP>/ with adam_m.bin (the fp32 values, in chunks of 8
# bytes so there are several) and its manifest.
write_checkpoint() {
    python3 - "$@" <<'PY'
import os, struct, sys
M = (1 << 64) - 1
def rotl(x, r): return ((x << r) | (x >> (64 - r))) & M
def fmix(x):
    x ^= x >> 33; x = (x * 0xff51afd7ed558ccd) & M; x ^= x >> 29; x = (x * 0xc4ceb9fe1a85ec53) & M
    return x ^ (x >> 32)
LANE, WORD = 0x9e3779b97f4a7c15, 0xd6e8feb86659fd93
def step(v, w): return (rotl(v ^ ((w * WORD) & M), 29) * LANE) & M
def checksum64(b):
    v = [0x243f6a8885a308d3, 0x13198a2e03707344, 0xa4093822299f31d0, 0x082efa98ec4e6c89]
    word = lambda i: int.from_bytes(b[i:i + 8].ljust(8, b"\0"), "little")
    i, lane = 0, 0
    while i + 32 <= len(b):
        v = [step(v[k], word(i + 8 * k)) for k in range(4)]
        i += 32
    while i < len(b):
        v[lane] = step(v[lane], word(i)); lane += 1; i += 8
    h = (len(b) * LANE) & M
    for k in range(4): h = (rotl(h ^ fmix((v[k] + k) & M), 23) * WORD) & M
    return fmix(h)
out, stepno, values = sys.argv[1], int(sys.argv[2]), [float(x) for x in sys.argv[3:]]
d = os.path.join(out, "ckpt_%08d" % stepno)
os.makedirs(d)
data = struct.pack("<%df" % len(values), *values)
open(os.path.join(d, "adam_m.bin"), "wb").write(data)
chunks = [(o, min(8, len(data) - o)) for o in range(0, len(data), 8)]
text = "llmc-checkpoint 1\nstep %d\nsetting model test\nfile adam_m.bin %d %d\n" % (stepno, len(data), len(chunks))
text += "".join("chunk %d %d %016x\n" % (o, n, checksum64(data[o:o + n])) for o, n in chunks)
text += "end %016x\n" % checksum64(text.encode())
open(os.path.join(d, "manifest.txt"), "w").write(text)
PY
}

source test/script_lib.sh
expect_bin=(./build/inspect_checkpoint)

write_checkpoint "$dir/good" 5 1.5 -2 0.25 3 4 5 6
expect_exit 0 "step 5, 1 files, checksums ok" "$dir/good/ckpt_00000005"
grep -q "adam_m.bin .* 28 bytes, fp32, all finite" "$dir/out" || { echo "FAIL: no file line"; cat "$dir/out"; exit 1; }
expect_exit 0 "1 checkpoint(s) whole, every value finite" --all "$dir/good"
echo "a whole checkpoint: ok"

# -q prints one line per checkpoint, whether the checkpoints are named or found with --all.
write_checkpoint "$dir/good" 6 1 2 3
for how in named --all; do
    if [ $how = named ]; then args=(-q "$dir/good/ckpt_00000005" "$dir/good/ckpt_00000006"); else args=(-q --all "$dir/good"); fi
    expect_exit 0 "2 checkpoint(s) whole" "${args[@]}"
    [ "$(grep -c ': ok$' "$dir/out")" = 2 ] && grep -q "^$dir/good/ckpt_00000005: ok$" "$dir/out" &&
        grep -q "^$dir/good/ckpt_00000006: ok$" "$dir/out" || { echo "FAIL: -q ($how): not one line per checkpoint"; cat "$dir/out"; exit 1; }
    ! grep -q "adam_m.bin" "$dir/out" || { echo "FAIL: -q ($how) printed the files"; cat "$dir/out"; exit 1; }
done
echo "-q, one line per checkpoint: ok"

write_checkpoint "$dir/nan" 7 1 nan 2
expect_exit 4 "adam_m.bin' holds 1 values that are not finite" --all "$dir/nan"
write_checkpoint "$dir/flip" 9 1 2 3 4 5
python3 -c 'import sys; p = sys.argv[1]; b = bytearray(open(p, "rb").read()); b[13] ^= 4; open(p, "wb").write(b)' \
    "$dir/flip/ckpt_00000009/adam_m.bin"
expect_exit 4 "adam_m.bin' is corrupted: bytes 8..16" --all "$dir/flip"
write_checkpoint "$dir/short" 11 1 2 3 4 5
truncate -s 17 "$dir/short/ckpt_00000011/adam_m.bin"
expect_exit 4 "adam_m.bin' is 17 bytes, the manifest records 20 (truncated)" "$dir/short/ckpt_00000011"
echo "damaged checkpoints: ok"

expect_exit 3 "$dir/missing" --all "$dir/missing"
mkdir "$dir/empty" "$dir/empty/ckpt_00000003.tmp"
expect_exit 4 "'$dir/empty' holds no checkpoint" --all "$dir/empty"
expect_exit 4 "'$dir/empty' holds no checkpoint" --all "$dir/good" "$dir/empty"
echo "--all without checkpoints: ok"
echo "PASS"
