#!/usr/bin/env bash
# --prompt "text" in both trainers: the text is encoded with GPT-2's tokenizer (tiktoken's ids for
# "The meaning of life is" are 464,3616,286,1204,318, which the trainer prints), and a greedy sample from --prompt equals the one
# from --prompt-ids with those ids, token for token, and the printed sample starts with the prompt text.
# Also: --prompt with --prompt-ids is a usage error (exit 2), and missing vocabulary files are named.
# A tiny random model (L=1, C=16, GPT-2's vocabulary), no data. The GPU trainer's part needs a GPU.
# Skips (77) where the trainer was built without PCRE2 or GPT-2's vocabulary files are not in .deps/gpt2.
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .deps/gpt2/encoder.json ] && [ -f .deps/gpt2/vocab.bpe ] ||
    { echo "skipped: GPT-2's vocabulary files are not in .deps/gpt2 (bash scripts/setup.sh)"; exit 77; }
dir=$(mktemp -d /tmp/prompt_text_XXXXXX)
trap 'rm -rf "$dir"' EXIT
fails=0
ids=464,3616,286,1204,318
check() {  # trainer name, then the trainer's command without prompt flags
    local name=$1; shift
    if ! "$@" -j "" -x 0 -g 8 --temperature 0 --prompt "The meaning of life is" -o "$dir/$name-text" >"$dir/$name-text.out" 2>&1; then
        if grep -q "no text encoder" "$dir/$name-text.out"; then
            echo "skip $name: built without PCRE2 (apt-get install libpcre2-dev, then rebuild)"; return 77
        fi
        echo "FAIL $name --prompt exited non-zero:"; cat "$dir/$name-text.out"; fails=$((fails + 1)); return 0
    fi
    "$@" -j "" -x 0 -g 8 --temperature 0 --prompt-ids "$ids" -o "$dir/$name-ids" >"$dir/$name-ids.out" 2>&1 ||
        { echo "FAIL $name --prompt-ids exited non-zero"; cat "$dir/$name-ids.out"; fails=$((fails + 1)); return 0; }
    if grep -qF "prompt: 5 token(s) [${ids}]" "$dir/$name-text.out"; then echo "ok   $name: the text is encoded as tiktoken does: $ids"
    else echo "FAIL $name: --prompt is not encoded as [$ids]:"; grep "^prompt" "$dir/$name-text.out" || true; fails=$((fails + 1)); fi
    local a b
    a=$(grep '"sample"' "$dir/$name-text/log.jsonl") b=$(grep '"sample"' "$dir/$name-ids/log.jsonl")
    if [ -n "$a" ] && [ "$a" = "$b" ]; then echo "ok   $name: --prompt and --prompt-ids $ids sample the same: $a"
    else echo "FAIL $name: --prompt sample '$a' differs from --prompt-ids sample '$b'"; fails=$((fails + 1)); fi
    if grep -q "^The meaning of life is|" "$dir/$name-text.out"; then echo "ok   $name: the sample is printed after its prompt"
    else echo "FAIL $name: no line starting with the prompt text"; cat "$dir/$name-text.out"; fails=$((fails + 1)); fi
    set +e
    "$@" -j "" -x 0 -g 8 --prompt "x" --prompt-ids 1 -o "$dir/$name-both" >"$dir/both.out" 2>&1; local rc=$?
    "$@" -j "" -x 0 -g 8 --prompt "x" --vocab-dir "$dir/none" -o "$dir/$name-none" >"$dir/none.out" 2>&1; local rc2=$?
    set -e
    if [ $rc -eq 2 ] && grep -q "not both" "$dir/both.out"; then echo "ok   $name: --prompt with --prompt-ids is refused"
    else echo "FAIL $name: --prompt with --prompt-ids: exit $rc"; cat "$dir/both.out"; fails=$((fails + 1)); fi
    if [ $rc2 -eq 2 ] && grep -q "$dir/none/encoder.json" "$dir/none.out"; then echo "ok   $name: missing vocabulary files are named"
    else echo "FAIL $name: --vocab-dir without files: exit $rc2"; cat "$dir/none.out"; fails=$((fails + 1)); fi
}
make -s train_gpt2
# The tokenizer file the samples are decoded with (a fresh clone has no data/ yet); without PCRE2 there is
# no prepare_data, and the trainers then refuse --prompt, which check() reports as a skip.
tok=()
if make -s build/prepare_data >/dev/null 2>&1; then
    build/prepare_data --write-tokenizer "$dir/tokenizer.bin" >/dev/null
    tok=(--tokenizer "$dir/tokenizer.bin")
fi
set +e; check cpu ./train_gpt2 --layers 1 --channels 16 --heads 1 "${tok[@]}"; cpu_rc=$?; set -e
gpu_rc=77
if nvidia-smi -L >/dev/null 2>&1; then
    make -s train_gpt2cu
    set +e; check gpu ./train_gpt2cu -e d2 -b 1 -t 64 "${tok[@]}"; gpu_rc=$?; set -e
else
    echo "skip gpu: no NVIDIA GPU"
fi
[ $fails -eq 0 ] || exit 1
if [ $cpu_rc -eq 77 ] && [ $gpu_rc -eq 77 ]; then echo "skipped: no trainer here encodes text"; exit 77; fi
exit 0
