#!/usr/bin/env python3
"""
Times our data preparation tool (build/prepare_data) against Python tiktoken's GPT-2 encoding on the
same text in the same run, single-threaded and with N threads (default 16), and prints a table of MB/s.

tiktoken is built offline from the same vocabulary files the tool reads (.deps/gpt2/encoder.json and
vocab.bpe, made by scripts/setup_npm.sh): its mergeable ranks are encoder.json's ids (GPT-2's ids are
its merge ranks; checked against vocab.bpe here) and its pattern is the one the installed tiktoken
uses for "gpt2" (r50k_pat_str), or GPT-2's original when that version does not name it. Nothing is
downloaded.

The text: every document under the inputs (default data/corpus, made by `make data`), read the way the
tool reads folders, repeated --repeat times. tiktoken encodes the list of documents with
encode_ordinary_batch(docs, num_threads=...); the tool encodes the same files (each input folder named
--repeat times) and writes shards. Before timing, the tool's shards are checked to hold exactly
tiktoken's ids (an <|endoftext|> before each document). Each timing is the best of --trials runs.
For the tool two figures are given: wall time of the whole process (start, vocabulary load, reading,
encoding, writing shards) and the encoding time the tool reports itself.

Does not: time anything but encoding, or compare other tokenizers.
"""
import argparse
import array
import json
import os
import re
import subprocess
import sys
import tempfile
import time

EOT = 50256


def gpt2_byte_alphabet():
    # GPT-2 writes each byte as a printable character: printable Latin-1 bytes as themselves, the others
    # as code points from 256 up, in byte order.
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    char_to_byte, extra = {}, 0
    for b in range(256):
        if b in printable:
            char_to_byte[chr(b)] = b
        else:
            char_to_byte[chr(256 + extra)] = b
            extra += 1
    return char_to_byte


def load_tiktoken_gpt2(encoder_json, vocab_bpe):
    import tiktoken

    char_to_byte = gpt2_byte_alphabet()
    to_bytes = lambda s: bytes(char_to_byte[c] for c in s)
    with open(encoder_json, encoding="utf-8") as f:
        encoder = json.load(f)
    ranks = {to_bytes(k): v for k, v in encoder.items() if k != "<|endoftext|>"}
    with open(vocab_bpe, encoding="utf-8") as f:
        merges = [line.split() for line in f.read().split("\n")[1:] if line]
    merged_ids = [ranks[to_bytes(a) + to_bytes(b)] for a, b in merges]
    if merged_ids != sorted(merged_ids) or len(set(merged_ids)) != len(merged_ids):
        sys.exit("bench_tokenizer: encoder.json's ids do not follow vocab.bpe's merge order")
    try:
        from tiktoken_ext.openai_public import r50k_pat_str as pattern
    except ImportError:
        pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    enc = tiktoken.Encoding(
        name="gpt2_offline",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": encoder["<|endoftext|>"]},
        explicit_n_vocab=len(encoder),
    )
    return enc, tiktoken.__version__


def list_files(path):
    if os.path.isdir(path):
        out = []
        for name in sorted(os.listdir(path), key=lambda n: n.encode()):
            out += list_files(os.path.join(path, name))
        return out
    return [path]


def read_shards(out_dir, name, split):
    ids = array.array("H")
    pattern = re.compile(re.escape(name) + "_" + split + r"_\d{6}\.bin$")
    for fname in sorted(f for f in os.listdir(out_dir) if pattern.match(f)):
        with open(os.path.join(out_dir, fname), "rb") as f:
            header = array.array("i")
            header.frombytes(f.read(1024))
            if header[0] != 20240520 or header[1] != 1:
                sys.exit(f"bench_tokenizer: {fname} is not a version 1 token shard")
            body = array.array("H")
            body.frombytes(f.read())
            if len(body) != header[2]:
                sys.exit(f"bench_tokenizer: {fname}: header says {header[2]} tokens, file holds {len(body)}")
            ids += body
    return ids


def run_tool(args, inputs, threads, out_dir):
    cmd = [args.tool, "--threads", str(threads), "--out", out_dir, "--name", "bench",
           "--encoder-json", args.encoder_json, "--vocab-bpe", args.vocab_bpe] + inputs
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"bench_tokenizer: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
    m = re.search(r"([\d.]+) MB in ([\d.]+) s:", r.stdout)
    if not m:
        sys.exit(f"bench_tokenizer: cannot read the tool's timing from:\n{r.stdout}")
    return wall, float(m.group(2))


def best_of(trials, fn):
    return min(fn() for _ in range(trials))


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    ap.add_argument("inputs", nargs="*", default=["data/corpus"], help="text files or folders (default data/corpus)")
    ap.add_argument("--tool", default="build/prepare_data")
    ap.add_argument("--encoder-json", default=".deps/gpt2/encoder.json")
    ap.add_argument("--vocab-bpe", default=".deps/gpt2/vocab.bpe")
    ap.add_argument("--threads", type=int, default=16, help="the multi-threaded setting (default 16)")
    ap.add_argument("--repeat", type=int, default=4, help="times the inputs are repeated (default 4)")
    ap.add_argument("--trials", type=int, default=2, help="runs per timing, best kept (default 2)")
    args = ap.parse_args()

    for p in [args.tool, args.encoder_json, args.vocab_bpe] + args.inputs:
        if not os.path.exists(p):
            sys.exit(f"bench_tokenizer: {p} not found (see the README: make data, scripts/setup.sh)")
    enc, version = load_tiktoken_gpt2(args.encoder_json, args.vocab_bpe)
    files = [f for p in args.inputs for f in list_files(p)]
    docs = []
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read()
        if raw:
            docs.append(raw.decode("utf-8"))  # tiktoken takes str, so the bench text must be UTF-8
    total_mb = sum(os.path.getsize(f) for f in files) / 1e6

    with tempfile.TemporaryDirectory() as tmp:
        # Same ids first: the tool's shards against tiktoken, document by document.
        run_tool(args, args.inputs, args.threads, tmp)
        ours = read_shards(tmp, "bench", "train")
        expected = array.array("H")
        for ids in enc.encode_ordinary_batch(docs, num_threads=args.threads):
            expected.append(EOT)
            expected.extend(ids)
        if ours != expected:
            first = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), min(len(ours), len(expected)))
            sys.exit(f"bench_tokenizer: ids differ from tiktoken's at token {first} "
                     f"(ours {len(ours)} tokens, tiktoken {len(expected)})")
        print(f"ids identical: {len(ours)} tokens from {len(docs)} documents, {total_mb:.1f} MB")

        bench_docs = docs * args.repeat
        bench_inputs = args.inputs * args.repeat
        mb = total_mb * args.repeat
        rows = []
        for threads in (1, args.threads):
            t_tik = best_of(args.trials, lambda: timed(lambda: enc.encode_ordinary_batch(bench_docs, num_threads=threads)))
            runs = [run_tool(args, bench_inputs, threads, tmp) for _ in range(args.trials)]
            wall = min(r[0] for r in runs)
            encode = min(r[1] for r in runs)
            rows.append((threads, t_tik, wall, encode))

    cpu = os.cpu_count()
    print(f"\nGPT-2 encoding of {mb:.1f} MB ({args.repeat} x {total_mb:.1f} MB, {len(bench_docs)} documents), "
          f"tiktoken {version}, {cpu} CPUs, best of {args.trials}")
    print(f"| threads | tiktoken MB/s | ours MB/s (whole run) | ours MB/s (encoding) | ours / tiktoken (whole run) |")
    print(f"|--------:|--------------:|----------------------:|---------------------:|----------------------------:|")
    for threads, t_tik, wall, encode in rows:
        print(f"| {threads:7d} | {mb / t_tik:13.1f} | {mb / wall:21.1f} | {mb / encode:20.1f} | {t_tik / wall:27.2f}x |")


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
