#!/usr/bin/env bash
# build/prepare_data's start-up checks, input warnings and bad inputs:
#   - the output folder is created (parents included), or refused at once with exit 3 naming it (below a
#     regular file; a read-only or full tmpfs in a user namespace where the system allows one), before
#     the vocabulary is loaded; the folder of --write-tokenizer likewise (it must exist);
#   - the output is all or nothing: a run that fails after writing many shards (a bad JSONL line after
#     3000 good ones, exit 4; a disk that fills, exit 3, in a user namespace where the system allows one)
#     or is stopped by SIGTERM leaves the output folder byte for byte as an earlier run left it, and
#     writes no --write-tokenizer file;
#   - one error line, with the file, the line and the system's reason: a JSON number out of range (exit 4),
#     a FIFO or a link loop as input, a directory or a FIFO as vocabulary file or --write-tokenizer
#     (exit 3), no input at all (exit 2, no usage text);
#   - a link inside an input folder that leads back to a folder it is in (sub/up -> ..) is skipped with a
#     warning naming it, and the rest encoded;
#   - a warning for each input that yields no document (an empty text file, a JSONL file of blank lines)
#     and for each text input of which more than a quarter of the bytes are not UTF-8 text (invalid
#     UTF-8, surrogates, overlong forms, control characters), and none for the others (UTF-8 text with
#     a BOM, emoji and tabs; a little Latin-1), which are encoded all the same.
# First, with nothing to build or read: scripts/prepare_corpus.sh (`make data`) runs tools from build/; run on
# its own (as test_tokenizer_reference.sh does when the corpus is missing, or by hand on a fresh clone), it
# must build each of them first, or it stops after the encoding with "build/...: No such file or
# directory": every build/ tool the script runs is a target of a make line that comes before it.
# Exit 0 pass, 1 fail, 77 skip (no PCRE2 headers to build the tool, or no GPT-2 vocabulary in .deps/; the
# prepare_corpus.sh check runs before either is looked for).
set -euo pipefail
cd "$(dirname "$0")/.."

script=scripts/prepare_corpus.sh
fails=0
built=""
while IFS= read -r line; do
    case "$line" in
        *make\ *build/*) built="$built $(grep -oE 'build/[A-Za-z0-9_]+' <<<"$line" | tr '\n' ' ')" ;;
        build/*)
            tool=$(grep -oE '^build/[A-Za-z0-9_]+' <<<"$line")
            if [[ " $built " != *" $tool "* ]]; then
                echo "FAIL: $script runs $tool before any make line builds it (built:$built)"
                fails=1
            fi
            ;;
    esac
done < <(sed -E 's/^[[:space:]]+//' "$script")
ran=$(grep -cE '^[[:space:]]*build/' "$script")
[ "$ran" -ge 2 ] || { echo "FAIL: expected $script to run build/prepare_data and build/prepare_eval, found $ran"; fails=1; }
[ $fails = 0 ] || exit 1
echo "ok: every build/ tool $script runs is built first"

if [ ! -f /usr/include/pcre2.h ]; then echo "skipped: no PCRE2 headers (libpcre2-dev) to build prepare_data"; exit 77; fi
if [ ! -f .deps/gpt2/encoder.json ] || [ ! -f .deps/gpt2/vocab.bpe ]; then
    echo "skipped: GPT-2's vocabulary is not in .deps/gpt2 (scripts/setup.sh)"; exit 77
fi
make -s build/prepare_data
dir=$(mktemp -d /tmp/prepare_data_checks_XXXXXX)
trap 'rm -rf "$dir"' EXIT
chmod 755 "$dir"

# Inputs: name -> bytes, from Python so the byte values are exact.
mkdir "$dir/in"
python3 - "$dir/in" <<'PY'
import sys
d = sys.argv[1]
files = {
    "empty.txt": b"",
    "blank.jsonl": b"\n  \n\n",
    "ok.jsonl": b'{"text": "a document"}\n\n',
    "utf8.txt": b"\xef\xbb\xbfcaf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\tand\r\nmore\x0c text\n" * 3,
    "latin1.txt": b"caf\xe9, na\xefve, r\xe9sum\xe9: mostly plain text with a few Latin-1 bytes in it.\n",
    "invalid30.txt": b"a" * 70 + b"\xff" * 30,
    "invalid20.txt": b"a" * 80 + b"\xff" * 20,
    "surrogates.txt": b"a" * 60 + b"\xed\xa0\x80" * 10,
    "overlong.txt": b"a" * 60 + b"\xc0\xaf" * 15,
    "controls.txt": b"a" * 70 + b"\x01\x00\x1b" * 10,
    "truncated.txt": b"a" * 60 + b"\xe2\x82" * 15,
    "whitespace.txt": b"a" * 50 + b"\t\n\r\x0c" * 12,
}
for name, data in files.items():
    open("%s/%s" % (d, name), "wb").write(data)
PY
build/prepare_data --out "$dir/out/a/b" "$dir/in" >"$dir/stdout" 2>"$dir/stderr" ||
    { echo "FAIL: prepare_data failed:"; cat "$dir/stderr"; exit 1; }
cat "$dir/stderr"
python3 - "$dir" <<'PY'
import re, sys
d = sys.argv[1]
err = open(d + "/stderr").read().splitlines()
no_docs = sorted(re.search(r"in/([^']+)'", l).group(1) for l in err if "yields no documents" in l)
not_text = sorted(re.search(r"in/([^']+)'", l).group(1) for l in err if "are not UTF-8 text" in l)
ok = True
if no_docs != ["blank.jsonl", "empty.txt"]:
    print("FAIL: 'yields no documents' warnings for %s, expected blank.jsonl and empty.txt" % no_docs); ok = False
want = ["controls.txt", "invalid30.txt", "overlong.txt", "surrogates.txt", "truncated.txt"]
if not_text != want: print("FAIL: 'not UTF-8 text' warnings for %s, expected %s" % (not_text, want)); ok = False
if not any("invalid30.txt': 30% of its 100 bytes" in l for l in err): print("FAIL: no '30% of its 100 bytes'"); ok = False
if not re.search(r"train +10 documents", open(d + "/stdout").read()):
    print("FAIL: expected the 10 non-empty inputs encoded as 10 documents:"); print(open(d + "/stdout").read()); ok = False
sys.exit(0 if ok else 1)
PY
[ -f "$dir/out/a/b/corpus_train_000000.bin" ] || { echo "FAIL: no shard in the created folder"; exit 1; }
[ -z "$(ls -A "$dir/out/a/b" | grep -v '^corpus_')" ] || { echo "FAIL: files left in the output folder"; exit 1; }
echo "warnings: ok"

# expect_error CODE FRAGMENT ARGS...: prepare_data ARGS exits with CODE, its last line holding FRAGMENT.
expect_error() {
    local code=$1 fragment=$2 rc=0
    shift 2
    timeout 20 build/prepare_data --quiet "$@" >"$dir/error.log" 2>&1 || rc=$?
    if [ $rc -ne "$code" ] || ! tail -n 1 "$dir/error.log" | grep -qF -- "$fragment"; then
        echo "FAIL: prepare_data $* exited $rc (expected $code with '$fragment'):"; cat "$dir/error.log"; exit 1
    fi
    echo "exit $code: $(tail -n 1 "$dir/error.log")"
}
mkdir "$dir/bad" "$dir/tok"
mkfifo "$dir/bad/fifo"
ln -s loop "$dir/bad/loop"
printf '{"text": "fine"}\n{"text": "hello", "score": 1e999}\n' >"$dir/bad/overflow.jsonl"
expect_error 4 "error: $dir/bad/overflow.jsonl:2: not valid JSON: number overflow parsing '1e999'" \
    --out "$dir/o" "$dir/bad/overflow.jsonl"
expect_error 3 "error: cannot read input '$dir/bad/fifo': is a FIFO, not a regular file" --out "$dir/o" "$dir/bad/fifo"
expect_error 3 "error: cannot read input '$dir/bad/loop': Too many levels of symbolic links" --out "$dir/o" "$dir/bad/loop"
expect_error 3 "error: cannot read GPT-2's vocabulary file '..': Is a directory;" \
    --encoder-json .. --out "$dir/o" "$dir/in/ok.jsonl"
expect_error 3 "error: cannot read GPT-2's vocabulary file '$dir/bad/fifo': is a FIFO, not a regular file;" \
    --vocab-bpe "$dir/bad/fifo" --out "$dir/o" "$dir/in/ok.jsonl"
expect_error 3 "error: --write-tokenizer '$dir/bad': Is a directory" --write-tokenizer "$dir/bad"
rc=0
build/prepare_data --out "$dir/o" >"$dir/stdout" 2>"$dir/stderr" || rc=$?
if [ $rc -ne 2 ] || [ "$(cat "$dir/stderr")" != "error: no input given (see --help)" ] || [ -s "$dir/stdout" ]; then
    echo "FAIL: no input: exited $rc (expected 2 and the one line 'error: no input given (see --help)'):"
    cat "$dir/stdout" "$dir/stderr"; exit 1
fi
echo "exit 2: $(cat "$dir/stderr")"

mkdir -p "$dir/looped/sub"
echo "the only document" >"$dir/looped/sub/doc.txt"
ln -s .. "$dir/looped/sub/up"
build/prepare_data --out "$dir/o" "$dir/looped" >"$dir/stdout" 2>"$dir/stderr" ||
    { echo "FAIL: a folder with a link loop:"; cat "$dir/stderr"; exit 1; }
if [ "$(cat "$dir/stderr")" != "warning: skipping '$dir/looped/sub/up': it leads back to '$dir/looped', a folder it is in" ] ||
    ! grep -qE "train +1 documents" "$dir/stdout"; then
    echo "FAIL: a folder with a link loop: expected one warning naming the link and 1 document:"
    cat "$dir/stdout" "$dir/stderr"; exit 1
fi
echo "link loop: $(cat "$dir/stderr")"

# All or nothing. An earlier run's shards in pub/; later runs that fail must leave them as they are.
python3 - "$dir/bad" <<'PY'
import random, sys
d = sys.argv[1]
r = random.Random(1)
words = "alpha beta gamma delta river stone light quick brown fox jumps over the lazy dog of and in to 42".split()
good = "".join('{"text": "document %d: %s"}\n' % (i, " ".join(r.choice(words) for _ in range(12))) for i in range(3000))
open(d + "/good.jsonl", "w").write(good)
open(d + "/good_then_bad.jsonl", "w").write(good + '{"text": oops}\n')
open(d + "/big.txt", "w").write(" ".join(r.choice(words) for _ in range(200000)))
PY
build/prepare_data --quiet --shard-tokens 20000 --out "$dir/pub" "$dir/bad/good.jsonl"
# snapshot DIR: every name in DIR (hidden ones too) and the checksum of each file.
snapshot() { (cd "$1" && ls -A && find . -type f -exec sha256sum {} + | sort); }
snapshot "$dir/pub" >"$dir/pub.before"
[ "$(ls "$dir/pub" | wc -l)" -ge 2 ] || { echo "FAIL: expected several shards from the earlier run:"; ls -A "$dir/pub"; exit 1; }
expect_error 4 "error: $dir/bad/good_then_bad.jsonl:3001: not valid JSON" --shard-tokens 1000 --chunk-bytes 4096 \
    --write-tokenizer "$dir/tok/tok.bin" --out "$dir/pub" "$dir/bad/good_then_bad.jsonl"
snapshot "$dir/pub" | diff "$dir/pub.before" - ||
    { echo "FAIL: a run that failed on line 3001 changed the earlier run's output folder (above)"; exit 1; }
[ ! -e "$dir/tok/tok.bin" ] || { echo "FAIL: a run that failed wrote its --write-tokenizer file"; exit 1; }
echo "a bad line after 3000 good ones: the earlier shards are as they were"

# SIGTERM once the run has begun to write shards (in OUT/.NAME.partial): it ends by the signal, and OUT is
# as it was.
build/prepare_data --quiet --shard-tokens 100 --chunk-bytes 4096 --out "$dir/pub" "$dir/bad/big.txt" \
    >"$dir/stdout" 2>"$dir/stderr" &
pid=$!
for _ in $(seq 400); do
    [ -e "$dir/pub/.corpus.partial/corpus_train_000000.bin" ] && break
    sleep 0.05
done
kill -TERM $pid 2>/dev/null || true
rc=0
wait $pid || rc=$?
if [ $rc -ne 143 ] || [ "$(cat "$dir/stderr")" != "error: stopped by a signal (Terminated): nothing was published, '$dir/pub' is as it was" ]; then
    echo "FAIL: SIGTERM: exited $rc (expected 143, the status of a SIGTERM, and one error line):"; cat "$dir/stderr"; exit 1
fi
snapshot "$dir/pub" | diff "$dir/pub.before" - || { echo "FAIL: a run stopped by SIGTERM changed the output folder (above)"; exit 1; }
echo "SIGTERM: $(cat "$dir/stderr")"

# expect_refused LABEL FRAGMENT [PREFIX...] -- ARGS...: prepare_data ARGS exits 3 within a second with
# FRAGMENT, before it loads the vocabulary (which prints the "prepare_data: N files" line).
expect_refused() {
    local label=$1 fragment=$2 rc=0
    shift 2
    local prefix=()
    while [ "$1" != "--" ]; do prefix+=("$1"); shift; done
    shift
    local t0 t1
    t0=$(date +%s%N)
    "${prefix[@]}" build/prepare_data "$@" >"$dir/out.log" 2>&1 || rc=$?
    t1=$(date +%s%N)
    local ms=$(( (t1 - t0) / 1000000 ))
    if [ $rc -ne 3 ] || ! grep -qF -- "$fragment" "$dir/out.log" || grep -q '^prepare_data: ' "$dir/out.log" ||
        [ $ms -ge 1000 ]; then
        echo "FAIL: $label: exited $rc after $ms ms (expected 3 within 1000 ms with '$fragment', before the vocabulary):"
        cat "$dir/out.log"
        exit 1
    fi
    echo "$label: exit 3 after $ms ms: $(tail -n 1 "$dir/out.log")"
}
touch "$dir/file"
expect_refused "output below a regular file" "cannot create directory '$dir/file/out': '$dir/file' exists and is not a directory" -- \
    --out "$dir/file/out" "$dir/in/ok.jsonl"
expect_refused "tokenizer in a missing folder" "--write-tokenizer '$dir/none/tok.bin': the folder '$dir/none' does not exist" -- \
    --out "$dir/out2" --write-tokenizer "$dir/none/tok.bin" "$dir/in/ok.jsonl"
mkdir "$dir/ro" "$dir/full"
if unshare -rm true 2>/dev/null; then
    export -f expect_refused expect_error snapshot
    export dir
    unshare -rm bash -c "
        set -euo pipefail
        mount -t tmpfs -o ro,size=64k tmpfs '$dir/ro'
        mount -t tmpfs -o size=64k tmpfs '$dir/full'
        dd if=/dev/zero of='$dir/full/fill' bs=4k count=64 2>/dev/null || true
        expect_refused 'read-only output folder' \"output folder '$dir/ro' is not writable\" -- --out '$dir/ro' '$dir/in/ok.jsonl'
        expect_refused 'new folder on a read-only file system' \"cannot create directory '$dir/ro/x': Read-only file system\" -- \
            --out '$dir/ro/x' '$dir/in/ok.jsonl'
        expect_refused 'full output folder' 'No space left on device' -- --out '$dir/full' '$dir/in/ok.jsonl'
        expect_refused 'tokenizer on a full file system' \"the folder of --write-tokenizer '$dir/full' is not writable\" -- \
            --write-tokenizer '$dir/full/tok.bin'
        mount -t tmpfs -o size=256k tmpfs '$dir/full'
        build/prepare_data --quiet --shard-tokens 20000 --out '$dir/full' '$dir/bad/good.jsonl'
        snapshot '$dir/full' >'$dir/full.before'
        expect_error 3 'No space left on device' --shard-tokens 20000 --out '$dir/full' '$dir/bad/big.txt'
        snapshot '$dir/full' | diff '$dir/full.before' - ||
            { echo 'FAIL: a run that filled the disk changed the output folder (above)'; exit 1; }
        echo 'a full disk: the earlier shards are as they were'
    "
else
    echo "note: no user namespaces here (unshare -rm): the read-only and full file system cases are left out"
fi
echo "ok"
