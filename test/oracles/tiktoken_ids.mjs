// Reference token ids from npm tiktoken@1.0.22 (get_encoding("gpt2"), encode_ordinary), for
// test/test_tokenizer_reference.sh. Two commands:
//
//   node test/oracles/tiktoken_ids.mjs compare SHARD... -- INPUT...
//     Reads the inputs the way build/prepare_data does (a folder means its files, recursively, in byte
//     order of the name; a .jsonl file is one document per non-blank line, its "text" field; any other
//     file is one document), encodes each document with tiktoken after an <|endoftext|> (50256), and
//     compares the ids with the tokens of the shards, concatenated in the order given. Prints the first
//     mismatch with its context and exits 1, or prints the count and exits 0. Inputs must be valid
//     UTF-8: JavaScript strings cannot carry other bytes, so such a comparison would mean nothing.
//
//   node test/oracles/tiktoken_ids.mjs cases HARD_CASES OUTDIR
//     Writes what the comparisons of hard cases need: OUTDIR/hard_cases_replaced.txt (the file decoded
//     as the WHATWG decoder does, each invalid sequence replaced by U+FFFD, written back as UTF-8),
//     OUTDIR/hard_cases_lines.jsonl (each line of that text as its own document, so that whitespace
//     at the end of a text occurs many times), and OUTDIR/unicode_sweep.txt (every Unicode scalar
//     value in contexts that show whether the pattern takes it for a letter, a digit, a space or
//     something else).
//
// Does not: decide anything about invalid UTF-8 (see the hard-cases comparison in the test script).

import { createRequire } from "node:module";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const tiktokenPath =
  process.env.TIKTOKEN_CJS ?? path.join(here, "..", "..", ".deps", "npm", "tiktoken-1.0.22", "package", "tiktoken.cjs");
const EOT = 50256;

function die(msg) {
  console.error(`tiktoken_ids: ${msg}`);
  process.exit(2);
}

function listFiles(p, out) {
  const st = fs.statSync(p);
  if (st.isDirectory()) {
    // Byte order of the UTF-8 names, as the tool sorts them.
    const names = fs.readdirSync(p).sort((a, b) => Buffer.compare(Buffer.from(a), Buffer.from(b)));
    for (const n of names) listFiles(path.join(p, n), out);
  } else {
    out.push(p);
  }
}

function decodeStrict(buf, file) {
  try {
    return new TextDecoder("utf-8", { fatal: true, ignoreBOM: true }).decode(buf);
  } catch {
    die(`${file} is not valid UTF-8; a JavaScript string cannot hold it, so it cannot be compared`);
  }
}

function* documents(inputs) {
  const files = [];
  for (const p of inputs) listFiles(p, files);
  for (const file of files) {
    const text = decodeStrict(fs.readFileSync(file), file);
    if (file.endsWith(".jsonl")) {
      const lines = text.split("\n");
      for (let i = 0; i < lines.length; i++) {
        if (/^[ \t\r]*$/.test(lines[i])) continue;
        yield { where: `${file}:${i + 1}`, text: JSON.parse(lines[i]).text };
      }
    } else if (text.length > 0) {
      yield { where: file, text };
    }
  }
}

function readShard(file) {
  const buf = fs.readFileSync(file);
  const header = new Int32Array(buf.buffer, buf.byteOffset, 256);
  if (header[0] !== 20240520) die(`${file}: bad magic ${header[0]}`);
  if (header[1] !== 1) die(`${file}: version ${header[1]}, expected 1 (uint16 tokens)`);
  const n = header[2];
  if (buf.length !== 1024 + 2 * n) die(`${file}: header says ${n} tokens but the file is ${buf.length} bytes`);
  return new Uint16Array(buf.buffer.slice(buf.byteOffset + 1024, buf.byteOffset + 1024 + 2 * n));
}

function compare(shardFiles, inputs) {
  const require = createRequire(import.meta.url);
  const { get_encoding } = require(tiktokenPath);
  const enc = get_encoding("gpt2");
  const shards = shardFiles.map(readShard);
  const ours = new Uint16Array(shards.reduce((n, s) => n + s.length, 0));
  shards.reduce((at, s) => (ours.set(s, at), at + s.length), 0);
  const show = (ids) =>
    Array.from(ids)
      .map((id) => `${id}=${JSON.stringify(new TextDecoder().decode(enc.decode(new Uint32Array([id]))))}`)
      .join(" ");
  let total = 0;
  for (const doc of documents(inputs)) {
    const body = enc.encode_ordinary(doc.text);
    const ids = new Uint32Array(body.length + 1);
    ids[0] = EOT;
    ids.set(body, 1);
    for (let i = 0; i < ids.length; i++) {
      if (total + i >= ours.length || ours[total + i] !== ids[i]) {
        const from = Math.max(0, i - 6);
        console.error(`MISMATCH in ${doc.where}, token ${i} of the document (${total + i} overall):`);
        console.error(`  tiktoken: ${show(ids.slice(from, i + 6))}`);
        console.error(`  ours:     ${show(ours.slice(total + from, total + i + 6))}`);
        process.exit(1);
      }
    }
    total += ids.length;
  }
  if (total !== ours.length) {
    console.error(`MISMATCH: the shards hold ${ours.length} tokens, the documents ${total}`);
    process.exit(1);
  }
  console.log(`${total} tokens identical to tiktoken`);
  enc.free();
}

function cases(hardCases, outDir) {
  fs.mkdirSync(outDir, { recursive: true });
  const replaced = new TextDecoder("utf-8", { ignoreBOM: true }).decode(fs.readFileSync(hardCases));
  fs.writeFileSync(path.join(outDir, "hard_cases_replaced.txt"), replaced);
  const lines = replaced.split("\n").map((line) => JSON.stringify({ text: line }));
  fs.writeFileSync(path.join(outDir, "hard_cases_lines.jsonl"), lines.join("\n") + "\n");
  const parts = [];
  for (let cp = 0; cp < 0x110000; cp++) {
    if (cp >= 0xd800 && cp < 0xe000) continue;
    const c = String.fromCodePoint(cp);
    parts.push(`a${c}b 1${c}2 !${c}? x ${c}y ${c}  ${c}'s${c}\n`);
  }
  fs.writeFileSync(path.join(outDir, "unicode_sweep.txt"), parts.join(""));
}

const [cmd, ...args] = process.argv.slice(2);
if (cmd === "compare") {
  const sep = args.indexOf("--");
  if (sep < 1 || sep === args.length - 1) die("usage: compare SHARD... -- INPUT...");
  compare(args.slice(0, sep), args.slice(sep + 1));
} else if (cmd === "cases" && args.length === 2) {
  cases(args[0], args[1]);
} else {
  die("usage: compare SHARD... -- INPUT...  |  cases HARD_CASES OUTDIR");
}
