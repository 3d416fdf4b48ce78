#!/usr/bin/env python3
"""Which kernels two builds compile differently: evidence that a refactor left device code alone.

    python3 dev/ptx_diff.py OLD NEW [--pair OLD_NAME_PART NEW_NAME_PART]...

OLD and NEW are both PTX (nvcc -ptx), both cubins (nvcc -cubin: machine code), or both the text of
`cuobjdump -sass` (which reads a cubin or an executable). Kernels are matched by mangled name; a kernel
whose name is gone is matched to a new one with the same code, so renamed namespaces or template
parameters show as `renamed`, not as gone and new. Prints the identical count, then the kernels that
differ, were renamed (same code), vanished or are new. For PTX, a kernel that differs also gets the
instructions whose count changed, which tells integer address arithmetic apart from a change in the
floating-point work; --pair names a kernel whose name and code both changed, to see the same for it.

What is compared:
  PTX    the body, after renaming the symbols and the labels whose numbers depend on the order of
         functions in the file (a template argument defaulted to false, `Lb0E`, is ignored in names).
  cubin  the bytes of the kernel's machine code (its .text section), its register count, its shared and
         parameter memory sizes, and its relocations (offset, type, target symbol): the instruction
         stream that `cuobjdump -sass` prints, without needing cuobjdump. Line tables (-lineinfo) are
         not compared.
  SASS   the instructions, without addresses and encodings.

The cubins of the trainer at a commit, as the Makefile compiles it for sm_90a:
    nvcc -std=c++17 -O3 -lineinfo -I. --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \\
         -DLLMC_SM90A=1 -cubin -o /tmp/new.cubin train_gpt2.cu
(for another GPU: -gencode arch=compute_80,code=sm_80, no -DLLMC_SM90A).
"""
import re
import struct
import sys


def ptx_kernels(text):
    out = {}
    # A kernel's body runs to the next function or the end (inline asm blocks close with "}" lines too).
    starts = [m for m in re.finditer(r"^(?:\.visible |\.weak )?\.(?:entry|func) .*?(\S+)\(", text, re.M)]
    for i, m in enumerate(starts):
        if ".entry" not in m.group(0):
            continue
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        name, body = m.group(1), text[m.start():end]
        body = re.sub(r"^\s*\.loc\b.*\n", "", body, flags=re.M)  # line numbers move with any edit
        body = re.sub(r"^//.*\n", "", body, flags=re.M)
        body = body.replace(name, "K")
        body = re.sub(r"_Z\w+", "SYM", body)
        body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
        body = re.sub(r"__local_depot\d+", "__local_depot", body)
        body = re.sub(r"\$L__tmp\d+", "$L__tmp", body)
        out[re.sub(r"Lb0E", "", name)] = body
    return out


def ptx_opcodes(body):
    """How often each instruction (with its type suffixes) occurs in a PTX body, inline asm included."""
    count = {}
    for line in body.splitlines():
        line = line.strip()
        if not line or line.startswith((".", "//", "{", "}", "$")) or line.endswith(":"):
            continue
        words = line.split()
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        count[op] = count.get(op, 0) + 1
    return count


def sass_kernels(text):
    out = {}
    for block in re.split(r"\n\s*Function : ", text)[1:]:
        name, _, body = block.partition("\n")
        instrs = []
        for line in body.splitlines():
            m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line)
            if m:
                instrs.append(m.group(1))
        out[name.strip()] = "\n".join(instrs)
    return out


def elf_sections(data):
    if data[4] != 2 or data[5] != 1:
        sys.exit("only 64-bit little-endian ELF cubins are read")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = []
    for i in range(shnum):
        name, typ, flags, addr, off, size, link, info, align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        secs.append(dict(name_off=name, type=typ, flags=flags, off=off, size=size, link=link, info=info,
                         entsize=entsize))
    strtab = secs[shstrndx]

    def cstr(table, off):
        start = table["off"] + off
        return data[start:data.index(b"\0", start)].decode()

    for s in secs:
        s["name"] = cstr(strtab, s["name_off"])
        s["data"] = data[s["off"]:s["off"] + s["size"]] if s["type"] != 8 else b""  # 8: NOBITS
    symtab = next(s for s in secs if s["type"] == 2)
    syms = []
    for i in range(symtab["size"] // 24):
        name, info, other, shndx, value, size = struct.unpack_from("<IBBHQQ", data, symtab["off"] + i * 24)
        syms.append(cstr(secs[symtab["link"]], name))
    return secs, syms


def nv_info(data, own, syms=None, fn=None):
    """The attributes of a .nv.info section. The section-wide one (own None): (symbol index, text) pairs of
    the entries that name a symbol first. A function's own (own its symbol index): texts, with a leading
    symbol index written as that symbol's name, the function's name in it replaced by SELF."""
    out, i = [], 0
    while i + 4 <= len(data):
        fmt, attr = data[i], data[i + 1]
        if fmt == 4:  # a sized value
            size, = struct.unpack_from("<H", data, i + 2)
            val, i = data[i + 4:i + 4 + size], i + 4 + size
        else:
            val, i = data[i + 2:i + 4], i + 4
        if fmt == 4 and len(val) >= 8:
            sym, = struct.unpack_from("<I", val, 0)
            if own is not None and sym < len(syms) and fn in syms[sym]:
                out.append("attr %#x %s %s" % (attr, syms[sym].replace(fn, "SELF"), val[4:].hex()))
                continue
            if own is None:
                out.append((sym, "attr %#x %s" % (attr, val[4:].hex())))
                continue
        if own is not None:
            out.append("attr %#x %s" % (attr, val.hex()))
    return out


def cubin_kernels(data):
    secs, syms = elf_sections(data)
    by_name = {s["name"]: s for s in secs}
    index = {name: i for i, name in enumerate(syms)}
    per_symbol = {}  # the section-wide .nv.info: register counts, frame sizes, ... by symbol index
    if ".nv.info" in by_name:
        for sym, text in nv_info(by_name[".nv.info"]["data"], None):
            per_symbol.setdefault(sym, []).append(text)
    out = {}
    for s in secs:
        if not s["name"].startswith(".text."):
            continue
        fn = s["name"][len(".text."):]
        own = index.get(fn)
        info_sym = s["info"] & 0xFFFFFF  # the function's symbol (registers in the top byte on older GPUs)
        info_name = syms[info_sym].replace(fn, "SELF") if info_sym < len(syms) else str(info_sym)
        desc = [s["data"].hex(), "registers %d, symbol %s, flags %#x" % (s["info"] >> 24, info_name, s["flags"])]
        desc += per_symbol.get(own, [])
        if ".nv.info." + fn in by_name:
            desc += nv_info(by_name[".nv.info." + fn]["data"], own, syms, fn)
        for kind in (".nv.shared.", ".nv.constant0."):
            other = by_name.get(kind + fn)
            desc.append("%s %d" % (kind, other["size"] if other else 0))
        for rel in (r for r in secs if r["type"] in (4, 9) and r["name"] in (".rel.text." + fn, ".rela.text." + fn)):
            step = 24 if rel["type"] == 4 else 16
            for i in range(0, len(rel["data"]), step):
                off, info = struct.unpack_from("<QQ", rel["data"], i)
                addend = struct.unpack_from("<q", rel["data"], i + 16)[0] if rel["type"] == 4 else 0
                target = syms[info >> 32]
                desc.append("reloc %x type %d %s %+d" % (off, info & 0xFFFFFFFF, "SELF" if target == fn else target,
                                                         addend))
        out[fn] = "\n".join(desc)
    return out


def kernels(path):
    data = open(path, "rb").read()
    if data[:4] == b"\x7fELF":
        return "cubin", cubin_kernels(data)
    text = data.decode(errors="replace")
    if re.search(r"^\s*Function : ", text, re.M):
        return "sass", sass_kernels(text)
    return "ptx", ptx_kernels(text)


def main():
    args = sys.argv[1:]
    pairs = []
    while "--pair" in args:
        i = args.index("--pair")
        if i + 2 >= len(args):
            sys.exit(__doc__)
        pairs.append((args[i + 1], args[i + 2]))
        del args[i:i + 3]
    if len(args) != 2:
        sys.exit(__doc__)
    (kind_old, old), (kind_new, new) = kernels(args[0]), kernels(args[1])
    if kind_old != kind_new:
        sys.exit(f"{sys.argv[1]} is {kind_old}, {sys.argv[2]} is {kind_new}: compare like with like")
    same = [k for k in old if new.get(k) == old[k]]
    gone = sorted(set(old) - set(new))
    fresh = sorted(set(new) - set(old))
    renamed = []
    for k in list(gone):
        match = [n for n in fresh if new[n] == old[k]]
        if match:
            renamed.append((k, match[0]))
            gone.remove(k)
            fresh.remove(match[0])
    print(f"{kind_old}: {len(same)} of {len(old)} kernels identical under the same name, "
          f"{len(renamed)} identical under a new name")
    for k in sorted(k for k in old if k in new and new[k] != old[k]):
        print("different:", k)
        if kind_old == "ptx":
            print_opcode_change(old[k], new[k])
    for k, n in renamed:
        print("renamed:  ", k, "->", n)
    for k in gone:
        print("gone:     ", k)
    for k in fresh:
        print("new:      ", k)
    # A kernel whose name changed and whose code did too (e.g. a template parameter became a constant):
    # name the pair with --pair OLD_SUBSTRING NEW_SUBSTRING to see how its instructions changed.
    for a, b in pairs:
        ka = [k for k in old if a in k]
        kb = [k for k in new if b in k]
        if len(ka) != 1 or len(kb) != 1:
            sys.exit(f"--pair {a} {b}: {len(ka)} old and {len(kb)} new kernels match; name one of each")
        print(f"pair:      {ka[0]} -> {kb[0]}: {'identical' if old[ka[0]] == new[kb[0]] else 'different'}")
        if kind_old == "ptx" and old[ka[0]] != new[kb[0]]:
            print_opcode_change(old[ka[0]], new[kb[0]])


def print_opcode_change(a, b):
    """The instructions whose count differs between two PTX bodies: where the difference lies (e.g. only
    in integer address arithmetic, or in floating-point work too)."""
    ca, cb = ptx_opcodes(a), ptx_opcodes(b)
    changed = {op: (ca.get(op, 0), cb.get(op, 0)) for op in sorted(set(ca) | set(cb)) if ca.get(op, 0) != cb.get(op, 0)}
    total = (sum(ca.values()), sum(cb.values()))
    if changed:
        print("           instructions %d -> %d; counts that differ: %s" %
              (total + (", ".join(f"{op} {x}->{y}" for op, (x, y) in changed.items()),)))
    else:
        print("           instructions %d -> %d; every instruction occurs as often as before" % total)


if __name__ == "__main__":
    main()
