#!/usr/bin/env bash
# The CPU trainer checks its output directory at start-up: an output directory it cannot write fails in
# under a second with exit code 3, a message naming the path and no training output, although the run
# asks for GPT-2 small (d12), whose set-up alone takes seconds. Cases: a path below a regular file,
# /dev/full, a directory without write permission (run as nobody when root), a read-only file system
# and a full one (tmpfs mounts in a user namespace, where the system allows one; else those two are
# left out with a note). A missing directory is created, parents included. A disk that fills while the
# trained model is written over an earlier run's (also on such a tmpfs) fails with exit code 3 and keeps
# the earlier model.bin whole; the error and the last line of the new log.jsonl beside it say that this
# model.bin is from before the run, so that nobody takes it for the run's result.
# Exit 0 pass, 1 fail.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s train_gpt2
dir=$(mktemp -d /tmp/train_gpt2_cpu_out_XXXXXX)
trap 'rm -rf "$dir"' EXIT
chmod 755 "$dir"
python3 test/make_synthetic_shards.py "$dir" syn_train=20000 syn_val=4000
touch "$dir/file"
mkdir "$dir/locked"
chmod 555 "$dir/locked"
big=(-e d12 -i "$dir/syn_train_*.bin" -j "$dir/syn_val_*.bin" -b 4 -t 64 -x 2 --tokenizer "$dir/none.bin")

# expect_refused LABEL PATH FRAGMENT [PREFIX...]: PREFIX... ./train_gpt2 -o PATH must exit 3 within a
# second, naming PATH and FRAGMENT, before any training output.
expect_refused() {
    local label=$1 path=$2 fragment=$3 rc=0
    shift 3
    local t0 t1
    t0=$(date +%s%N)
    "$@" ./train_gpt2 "${big[@]}" -o "$path" >"$dir/out" 2>&1 || rc=$?
    t1=$(date +%s%N)
    local ms=$(( (t1 - t0) / 1000000 ))
    if [ $rc -ne 3 ] || ! grep -qF "'$path'" "$dir/out" || ! grep -qF -- "$fragment" "$dir/out" ||
        grep -q '^step \|^model: ' "$dir/out" || [ $ms -ge 1000 ]; then
        echo "FAIL: $label: -o $path exited $rc after $ms ms (expected 3 within 1000 ms, naming the path and"
        echo "      '$fragment', before the model is built):"
        cat "$dir/out"
        exit 1
    fi
    echo "$label: exit 3 after $ms ms: $(tail -n 1 "$dir/out")"
}

expect_refused "below a regular file" "$dir/file/out" "is not a directory"
expect_refused "/dev/full" /dev/full "is not a directory"
if [ "$(id -u)" -eq 0 ]; then
    if command -v setpriv >/dev/null; then
        expect_refused "no write permission" "$dir/locked/out" "Permission denied" \
            setpriv --reuid=65534 --regid=65534 --clear-groups
    else
        echo "note: setpriv is missing: the permission case is left out (root ignores permissions)"
    fi
else
    expect_refused "no write permission" "$dir/locked/out" "Permission denied"
fi

# Read-only and full file systems: tmpfs mounts inside a user and mount namespace.
mkdir "$dir/ro" "$dir/full" "$dir/fills"
# expect_save_fails: a run whose final save meets a full disk, over the model.bin of an earlier run.
expect_save_fails() {
    local out=$dir/fills/run rc=0
    local tiny=(-i "$dir/syn_train_*.bin" -j "" --layers 1 --channels 8 --heads 2 --max-seq-len 16 -b 2 -t 8 -x 2)
    ./train_gpt2 "${tiny[@]}" --seed 1 -o "$out" >"$dir/out" 2>&1 || { echo "FAIL: the earlier run"; cat "$dir/out"; exit 1; }
    cp "$out/model.bin" "$dir/earlier.bin"
    # Fill the disk but for 64 KiB: room for the new run's log.jsonl, not for its 1.6 MB model.bin.
    dd if=/dev/zero of="$dir/fills/spare" bs=64k count=1 2>/dev/null
    dd if=/dev/zero of="$dir/fills/fill" bs=64k 2>/dev/null || true
    rm "$dir/fills/spare"
    ./train_gpt2 "${tiny[@]}" --seed 2 -o "$out" >"$dir/out" 2>&1 || rc=$?
    if [ $rc -ne 3 ] || ! grep -q "^error: .*No space left on device.*; so $out/model.bin is from before this run, not its result (log.jsonl's last line says so)$" "$dir/out"; then
        echo "FAIL: a save onto a full disk exited $rc (expected 3, saying that $out/model.bin is an earlier run's):"
        cat "$dir/out"; exit 1
    fi
    cmp -s "$out/model.bin" "$dir/earlier.bin" || { echo "FAIL: the failed save changed the earlier model.bin"; exit 1; }
    tail -n 1 "$out/log.jsonl" | grep -q "^{\"step\":2,\"save_failed\":\".*No space left on device.*\",\"earlier_files\":\[\"$out/model.bin\"\]}$" ||
        { echo "FAIL: log.jsonl does not end with the failed save:"; cat "$out/log.jsonl"; exit 1; }
    grep -q '"step":2,"loss"' "$out/log.jsonl" || { echo "FAIL: log.jsonl is not the new run's"; exit 1; }
    echo "a full disk at the final save: exit 3, the earlier model.bin whole, marked as such in the error and the log: ok"
}
if unshare -rm true 2>/dev/null; then
    export -f expect_refused expect_save_fails
    export dir
    big_list=$(printf '%q ' "${big[@]}")
    unshare -rm bash -c "
        set -euo pipefail
        big=($big_list)
        mount -t tmpfs -o ro,size=64k tmpfs '$dir/ro'
        mount -t tmpfs -o size=64k tmpfs '$dir/full'
        dd if=/dev/zero of='$dir/full/fill' bs=4k count=64 2>/dev/null || true
        expect_refused 'read-only file system (existing directory)' '$dir/ro' 'Read-only file system'
        expect_refused 'read-only file system (new directory)' '$dir/ro/out' 'Read-only file system'
        expect_refused 'full file system (existing directory)' '$dir/full' 'No space left on device'
        mount -t tmpfs -o size=4m tmpfs '$dir/fills'
        expect_save_fails
    "
else
    echo "note: no user namespaces here (unshare -rm): the read-only and full file system cases (at start-up and at"
    echo "      the final save) are left out"
fi

# A missing directory, parents included, is created; the run then trains (a tiny model) and writes there.
./train_gpt2 -i "$dir/syn_train_*.bin" -j "" --layers 1 --channels 8 --heads 2 -b 2 -t 8 -x 2 \
    -o "$dir/new/a/b" >"$dir/out"
[ -f "$dir/new/a/b/log.jsonl" ] && [ -f "$dir/new/a/b/model.bin" ] ||
    { echo "FAIL: -o $dir/new/a/b: no log.jsonl and model.bin there"; cat "$dir/out"; exit 1; }
[ "$(ls -A "$dir/new/a/b" | tr '\n' ' ')" = "log.jsonl model.bin " ] ||
    { echo "FAIL: the output directory holds $(ls -A "$dir/new/a/b")"; exit 1; }
echo "a missing output directory is created: ok"
echo "ok"
