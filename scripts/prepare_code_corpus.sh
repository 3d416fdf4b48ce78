#!/usr/bin/env bash
# A corpus that a run of up to ~50 M tokens reads once, for judging numerics (a change against bf16's own spread) on data that
# does not repeat: the Python sources of the packages installed beside python3 (site-packages), one
# document a file, duplicates dropped, visited in the order of their content's hash (so every shard mixes
# the packages), about 1 in 32 files held out for validation (chosen by that hash too).
#   bash scripts/prepare_code_corpus.sh [MB]      MB of source to keep (default 125: ~55 M train tokens)
# Writes data/code/{train,val}.jsonl, then with build/prepare_data the shards data/code_{train,val}_NNNNNN.bin.
# The corpus is a function of the installed packages: the script prints the files, documents and tokens, so
# two machines can tell whether theirs match. PREPARE_DATA names another build of prepare_data (one built
# where the PCRE2 headers are, for a machine without them).
set -euo pipefail
cd "$(dirname "$0")/.."
MB=${1:-125}
[[ "$MB" =~ ^[1-9][0-9]*$ ]] || { echo "usage: bash scripts/prepare_code_corpus.sh [MB]" >&2; exit 2; }
PREPARE_DATA=${PREPARE_DATA:-build/prepare_data}
[ "$PREPARE_DATA" != build/prepare_data ] || make -s build/prepare_data
mkdir -p data/code
python3 - data/code "$MB" <<'PY'
import hashlib, json, os, site, sys
out, cap = sys.argv[1], int(sys.argv[2]) * 1000 * 1000
files = []
for root in sorted(set(site.getsitepackages())):
    for d, _, names in os.walk(root):
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
seen, items = set(), []
for p in sorted(files):
    try:
        b = open(p, "rb").read()
    except OSError:
        continue
    h = hashlib.sha256(b).hexdigest()
    if len(b) >= 2048 and h not in seen:  # short files are mostly boilerplate
        seen.add(h)
        items.append((h, b))
items.sort()
kept, docs = 0, [0, 0]
with open(out + "/train.jsonl", "w") as tr, open(out + "/val.jsonl", "w") as va:
    for h, b in items:
        if kept >= cap:
            break
        val = int(h[:8], 16) % 32 == 0
        (va if val else tr).write(json.dumps({"text": b.decode("utf-8", "replace")}) + "\n")
        docs[val] += 1
        kept += len(b)
print("prepare_code_corpus: %d .py files, %d distinct of 2 KB or more; kept %d train + %d val files, %.1f MB"
      % (len(files), len(items), docs[0], docs[1], kept / 1e6))
if kept < cap:
    print("prepare_code_corpus: note: the installed packages hold less than %d MB of such source" % (cap // 1000000))
PY
"$PREPARE_DATA" --out data --name code --val data/code/val.jsonl data/code/train.jsonl
