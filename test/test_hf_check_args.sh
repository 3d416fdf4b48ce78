#!/usr/bin/env bash
# dev/hf_check.py's --only, without a GPU or transformers (stand-in torch and transformers modules, an
# empty shard): a section letter it does not know ("d", "x", or an empty list) is refused with exit 2
# naming it, before anything runs, rather than skipped, which ended "0 passed, 0 failed" with exit 0
# having checked nothing; blanks around the letters are allowed ("a, c"), and a known section runs
# (section a, with a trainer that fails at once, reports FAIL (a) and exit 1).
# Exit 0 pass, 1 fail, 77 skip (python3 without numpy).
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's python3 (where apt installs numpy), not another python3 that may come first on the PATH.
py=/usr/bin/python3
[ -x "$py" ] || py=python3
if ! "$py" -c "import numpy" 2>/dev/null; then
    echo "skipped: $py cannot import numpy (apt-get install python3-numpy)"
    exit 77
fi
dir=$(mktemp -d /tmp/test_hf_check_args_XXXXXX)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/stub/torch" "$dir/stub/transformers"
cat >"$dir/stub/torch/__init__.py" <<'PY'
import types
__version__ = "stand-in"
backends = types.SimpleNamespace(cuda=types.SimpleNamespace(matmul=types.SimpleNamespace()),
                                 cudnn=types.SimpleNamespace())
def set_float32_matmul_precision(precision):
    pass
PY
echo '__version__ = "4.0.0"' >"$dir/stub/transformers/__init__.py"
: >"$dir/train_000000.bin"
: >"$dir/val_000000.bin"

fail() { echo "FAIL: $*"; cat "$dir/out"; exit 1; }
check() {  # check ONLY: the script's output in $dir/out, its exit code in rc
    rc=0
    PYTHONPATH="$dir/stub" timeout 60 "$py" dev/hf_check.py --only "$1" --work "$dir/work" --device cpu \
        --trainer /bin/false --train "$dir/train_*.bin" --val "$dir/val_*.bin" >"$dir/out" 2>&1 || rc=$?
}

for only in d a,x "a, c, e" ""; do
    check "$only"
    [ $rc -eq 2 ] || fail "--only '$only' exited $rc, not 2"
    grep -q -- "--only" "$dir/out" || fail "--only '$only': the refusal does not name the flag"
    ! grep -q "^hf_check:" "$dir/out" || fail "--only '$only' ran and summed up nothing"
done
check "a, c, e"
grep -q "'e'" "$dir/out" && ! grep -q "' c'" "$dir/out" || fail "--only 'a, c, e': does not name 'e' alone"
echo "ok: an unknown section is refused with exit 2, naming it"

check " a"
[ $rc -eq 1 ] && grep -q "^FAIL (a) train_gpt2cu" "$dir/out" || fail "--only ' a' did not run section a (exit $rc)"
echo "ok: a known section runs"
