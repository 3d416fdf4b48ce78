#!/usr/bin/env python3
"""Which kernels two PTX files compile differently: evidence that a refactor left device code alone.

    git worktree add /tmp/old REV && (cd /tmp/old && nvcc -std=c++17 -O3 -I. -arch=sm_90 --expt-relaxed-constexpr -ptx -o /tmp/old.ptx train_gpt2.cu)
    nvcc -std=c++17 -O3 -I. -arch=sm_90 --expt-relaxed-constexpr -ptx -o /tmp/new.ptx train_gpt2.cu
    python3 dev/ptx_diff.py /tmp/old.ptx /tmp/new.ptx

Kernels are matched by mangled name (a template argument defaulted to false, `Lb0E`, is ignored, so a
kernel that gained `bool Pipe = false` still matches); bodies are compared after renaming the symbols and
the labels whose numbers depend on the order of functions in the file. Prints the identical count, then
the kernels that differ, vanished or are new.
"""
import re
import sys


def kernels(path):
    out = {}
    for m in re.finditer(r"\.entry (\S+)\((.*?)\n\}\n", open(path).read(), re.S):
        name, body = m.group(1), m.group(0)
        body = body.replace(name, "K")
        body = re.sub(r"_Z\w+", "SYM", body)
        body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
        body = re.sub(r"__local_depot\d+", "__local_depot", body)
        body = re.sub(r"\$L__tmp\d+", "$L__tmp", body)
        out[re.sub(r"Lb0E", "", name)] = body
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
    same = [k for k in old if new.get(k) == old[k]]
    print(f"{len(same)} of {len(old)} kernels identical")
    for k in sorted(k for k in old if k in new and new[k] != old[k]):
        print("different:", k)
    for k in sorted(set(old) - set(new)):
        print("gone:     ", k)
    for k in sorted(set(new) - set(old)):
        print("new:      ", k)


if __name__ == "__main__":
    main()
