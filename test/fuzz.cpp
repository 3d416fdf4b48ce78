/*
Fuzz targets for every reader of outside bytes, as one libFuzzer program (build/fuzz, `make fuzz`,
docs/fuzzing.md). FUZZ_TARGET names the reader an input goes to:

  safetensors   a safetensors file: its header and tensors, then as a Hugging Face folder's model.safetensors
  hf_index      model.safetensors.index.json of a sharded Hugging Face folder (two good shards beside it)
  hf_config     config.json of a Hugging Face folder (a good model.safetensors beside it)
  model_file    an llm.c model file, version 3 or 5: probed, then loaded
  shard         a token shard: its header, then every batch of an epoch through the DataLoader
  eval          a multiple-choice eval .bin: read, checked, cut into batches as the CPU and GPU lay them out
  tokenizer     llm.c's tokenizer file
  manifest      a checkpoint's manifest.txt (the input without its 'end' line, which the target appends with
                the right checksum): validated against a checkpoint's files, its optimizer-state layout
                read, its DataLoader and step-guard blobs restored
  jsonl         lines of prepare_data's JSONL input
and, in a build with PCRE2 (LLMC_TOKENIZER_ENCODER):
  hellaswag     lines of HellaSwag's JSONL (prepare_eval --hellaswag)
  vocab         encoder.json, a NUL byte, then vocab.bpe
  encoder       text through GPT-2's encoder (.deps/gpt2): decode(encode(x)) must give x back, and text cut
                at safe_split_point() must encode as the whole does

An input a reader refuses must be refused with an llmc::Error whose exit code is the README's for bad
contents (4), or for I/O (3) where the input names other files, and whose message is one line. Anything
else is a finding and aborts: another code (a short read where the length was never checked gives 3), a
foreign exception (nlohmann's, std::out_of_range), a crash, a sanitizer report, a leak, a hang or a memory
blow-up (libFuzzer's -timeout, -rss_limit_mb, -malloc_limit_mb).

Inputs are written to files in a directory of the process's own under $TMPDIR (else /dev/shm, else /tmp),
beside the fixtures a target needs (a tiny model's folder, a checkpoint's files, a shard), made once per
process. FUZZ_TARGET=list prints the targets; FUZZ_WRITE_SEEDS=DIR writes the seed corpus, made with the
programs' own writers, to DIR/<target>/ for FUZZ_TARGET (or every target when it is unset); FUZZ_VERBOSE=1
says why each input was refused.
*/
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cpu/mc_eval_cpu.h"
#include "llmc/checkpoint.h"
#include "llmc/dataloader.h"
#include "llmc/mc_eval.h"
#include "llmc/model_io.h"
#include "llmc/run_control.h"
#include "llmc/shard.h"
#include "llmc/tokenizer.h"
#include "llmc/utils.h"
#include "dev/tools/jsonl.h"

namespace {

using namespace llmc;
using Seeds = std::vector<std::pair<std::string, std::string>>;  // file name -> bytes

// ----------------------------------------------------------------------------------------------------
// Files

std::string g_dir;  // this process's scratch directory

void remove_scratch() {
    std::error_code ec;
    if (!g_dir.empty()) std::filesystem::remove_all(g_dir, ec);
}

// Reports a finding on one line (control characters written as \xNN) and aborts, which libFuzzer records.
[[noreturn]] void finding(const std::string& what) {
    std::string shown;
    for (unsigned char c : what) shown += c < 0x20 || c == 0x7f ? format("\\x%02x", c) : std::string(1, char(c));
    std::fprintf(stderr, "fuzz: finding: %s\n", shown.c_str());
    std::fflush(stderr);
    remove_scratch();
    std::abort();
}

const std::string& scratch() {
    if (g_dir.empty()) {
        const char* tmp = std::getenv("TMPDIR");
        std::string base = tmp && *tmp ? tmp : directory_exists("/dev/shm") ? "/dev/shm" : "/tmp";
        std::string templ = base + "/llmc-fuzz-XXXXXX";
        if (::mkdtemp(templ.data()) == nullptr) {
            std::fprintf(stderr, "fuzz: cannot create a directory in %s: %s\n", base.c_str(), std::strerror(errno));
            std::exit(2);
        }
        g_dir = templ;
        std::atexit(remove_scratch);
    }
    return g_dir;
}

std::string write_file(const std::string& path, const std::string& bytes) {
    File f(path, File::Mode::Write);
    f.write_all(bytes.data(), bytes.size());
    f.close();
    return path;
}

std::string read_file(const std::string& path) {
    File f(path, File::Mode::Read);
    std::string s(size_t(f.size()), '\0');
    f.read_exact(s.data(), s.size());
    return s;
}

// What a writer that takes a path makes, as bytes.
std::string written_by(const std::function<void(const std::string&)>& write) {
    const std::string path = scratch() + "/written";
    write(path);
    std::string bytes = read_file(path);
    std::filesystem::remove(path);
    return bytes;
}

std::string subdir(const std::string& name) {
    const std::string d = scratch() + "/" + name;
    make_directories(d);
    return d;
}

// ----------------------------------------------------------------------------------------------------
// Fixtures: a tiny GPT-2 (L=2, C=4, NH=2, V=5, maxT=3; Vp=128), its parameters, files made from them.

const GPT2Config& tiny() {
    static const GPT2Config c = make_config(2, 4, 2, 5, 3);
    return c;
}

const std::vector<float>& tiny_params() {
    static const std::vector<float> p = [] {
        std::vector<float> v(size_t(num_parameters(tiny())));
        init_parameters(tiny(), 1, v.data());
        return v;
    }();
    return p;
}

// The tiny model's tensors in Hugging Face's names and layout, for hand-made safetensors files.
struct HfTensor {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> values;
};

std::vector<HfTensor> tiny_hf_tensors() {
    std::vector<HfTensor> out;
    const float* p = tiny_params().data();
    for (const HfTensorMap& m : hf_tensor_map(tiny())) {
        HfTensor t{std::string(kHfPrefix) + m.name, m.shape, std::vector<float>(size_t(m.numel))};
        if (m.transposed) {
            transpose_into(t.values.data(), p + m.offset, m.shape[0], m.shape[1]);
        } else {
            std::copy(p + m.offset, p + m.offset + m.numel, t.values.begin());
        }
        out.push_back(std::move(t));
    }
    return out;
}

std::string safetensors_of(const std::vector<HfTensor>& tensors, const char* dtype) {
    return written_by([&](const std::string& path) {
        std::vector<SafetensorsSpec> specs;
        for (const HfTensor& t : tensors) specs.push_back({t.name, dtype, t.shape});
        SafetensorsWriter w(path, specs);
        for (const HfTensor& t : tensors) w.write(t.values.data(), int64_t(t.values.size()));
        w.finish();
    });
}

std::string tiny_config_json() { return hf_config_json(tiny(), "float32").dump(2) + "\n"; }

// IEEE binary16 of a float of normal half range, truncated (the seeds' values are small and normal, or 0).
uint16_t float_to_fp16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const int exponent = int((bits >> 23) & 0xff) - 127 + 15;
    if (exponent <= 0) return uint16_t((bits >> 16) & 0x8000u);
    return uint16_t(((bits >> 16) & 0x8000u) | (uint32_t(exponent) << 10) | ((bits >> 13) & 0x3ffu));
}

// A safetensors file of a header's text (padded with spaces to 8 bytes) and a data section.
std::string safetensors_file(std::string text, const std::string& data) {
    text.append((8 - text.size() % 8) % 8, ' ');
    const uint64_t n = text.size();
    return std::string(reinterpret_cast<const char*>(&n), 8) + text + data;
}

// A safetensors file's header text (without its padding) and data section.
std::pair<std::string, std::string> safetensors_parts(const std::string& file) {
    uint64_t n;
    std::memcpy(&n, file.data(), 8);
    std::string text = file.substr(8, n);
    text.erase(text.find_last_not_of(' ') + 1);
    return {text, file.substr(8 + n)};
}

// A safetensors file written by hand: F16 values, unprefixed names, metadata, an attention-mask buffer.
std::string hand_made_safetensors() {
    std::string data;
    nlohmann::json header;
    header["__metadata__"] = {{"format", "pt"}, {"note", "hand made"}};
    auto add = [&](const std::string& name, const char* dtype, const std::vector<int64_t>& shape,
                   const std::string& bytes) {
        header[name] = {{"dtype", dtype}, {"shape", shape},
                        {"data_offsets", {data.size(), data.size() + bytes.size()}}};
        data += bytes;
    };
    for (const HfTensor& t : tiny_hf_tensors()) {
        std::string half;
        for (float f : t.values) {
            const uint16_t h = float_to_fp16(f);
            half.append(reinterpret_cast<const char*>(&h), 2);
        }
        add(t.name.substr(std::strlen(kHfPrefix)), "F16", t.shape, half);
    }
    add("h.0.attn.bias", "U8", {1, 1, 3, 3}, std::string(9, '\1'));
    return safetensors_file(header.dump(), data);
}

// ----------------------------------------------------------------------------------------------------
// The targets

struct Target {
    const char* name;
    bool names_files;  // the input names other files, so a missing one is an I/O error (exit 3)
    bool (*setup)();   // makes the fixtures, before the first input (or null); false: cannot run here
    void (*run)(const std::string& input);
    Seeds (*seeds)();  // names starting "bad_" must be refused, the others accepted
};

const Target* g_target = nullptr;  // the one FUZZ_TARGET names (or whose seeds are being written)

// What is wrong with the way a target's reader refused an input: "" when the refusal is the README's.
std::string wrong_refusal(const Target& t, const Error& e) {
    const int code = e.exit_code();
    if (code != kExitData && !(code == kExitIo && t.names_files)) {
        return format("refused with exit code %d, expected %d%s: %s", code, int(kExitData),
                      t.names_files ? " or 3" : "", e.what());
    }
    if (std::strpbrk(e.what(), "\r\n") != nullptr) return format("a message of several lines: %s", e.what());
    return "";
}

// Runs one reading of the input that may refuse it, for a target that reads an input in several ways.
void attempt(const std::function<void()>& read) {
    try {
        read();
    } catch (const Error& e) {
        const std::string wrong = wrong_refusal(*g_target, e);
        if (!wrong.empty()) finding(wrong);
    }
}

// safetensors ---------------------------------------------------------------------------------------

const std::string& safetensors_dir() {
    static const std::string dir = [] {
        const std::string d = subdir("safetensors");
        write_file(d + "/config.json", tiny_config_json());
        return d;
    }();
    return dir;
}

void run_safetensors(const std::string& in) {
    const std::string& dir = safetensors_dir();
    const std::string path = write_file(dir + "/model.safetensors", in);
    SafetensorsFile f(path);
    std::vector<float> values;
    for (const SafetensorsTensor& t : f.tensors()) {
        if (!safetensors_float_dtype(t.dtype)) continue;
        values.resize(size_t(t.numel));
        f.read_floats(t, values.data());
    }
    const ModelInfo info = probe_model(dir);
    load_model_params(dir, info);
}

Seeds seeds_safetensors() {
    const std::string f32 = safetensors_of(tiny_hf_tensors(), "F32");
    std::vector<HfTensor> with_head = tiny_hf_tensors();
    with_head.push_back({"lm_head.weight", with_head[0].shape, with_head[0].values});
    const std::string hand = hand_made_safetensors();
    uint64_t header_bytes;
    std::memcpy(&header_bytes, hand.data(), 8);
    std::string nan = f32;
    const float q = NAN;
    std::memcpy(&nan[nan.size() - 4], &q, 4);
    // Faults each check of the reader must catch on its own; the rest of each file is good.
    const auto [text, data] = safetensors_parts(f32);
    std::string dtype_twice = text;
    dtype_twice.replace(dtype_twice.find("\"dtype\":\"F32\""), 0, "\"dtype\":\"BF16\",");
    std::string past_end = f32;
    const uint64_t n_past = f32.size() - 8 + 4;
    std::memcpy(&past_end[0], &n_past, 8);
    nlohmann::json long_span = nlohmann::json::parse(text);
    nlohmann::json& last_end = long_span["transformer.ln_f.bias"]["data_offsets"][1];  // the data section's end
    last_end = last_end.get<int64_t>() + 4;
    return {{"f32.safetensors", f32},
            {"bf16.safetensors", safetensors_of(tiny_hf_tensors(), "BF16")},
            {"f32_lm_head.safetensors", safetensors_of(with_head, "F32")},
            {"f16_unprefixed_mask.safetensors", hand},
            {"bad_truncated.safetensors", f32.substr(0, f32.size() - 6)},
            {"bad_nan.safetensors", nan},
            {"bad_header_only.safetensors", hand.substr(0, 8 + header_bytes)},
            {"bad_shape_1e999.safetensors",
             safetensors_file(R"({"x": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}})",
                              std::string(4, '\0'))},
            {"bad_nul_in_header.safetensors", safetensors_file(text + std::string(1, '\0'), data)},
            {"bad_dtype_twice.safetensors", safetensors_file(dtype_twice, data)},
            {"bad_header_past_end.safetensors", past_end},
            {"bad_span_too_long.safetensors", safetensors_file(long_span.dump(), data + std::string(4, '\0'))}};
}

// hf_index ------------------------------------------------------------------------------------------

// Tensors up to and including layer 0 in the first shard, the rest in the second.
std::pair<std::vector<HfTensor>, std::vector<HfTensor>> tiny_hf_halves() {
    std::pair<std::vector<HfTensor>, std::vector<HfTensor>> halves;
    for (HfTensor& t : tiny_hf_tensors()) {
        const bool second = t.name.find(".h.1.") != std::string::npos || t.name.find("ln_f") != std::string::npos;
        (second ? halves.second : halves.first).push_back(std::move(t));
    }
    return halves;
}

const char* kShard1 = "model-00001-of-00002.safetensors";
const char* kShard2 = "model-00002-of-00002.safetensors";

const std::string& hf_index_dir() {
    static const std::string dir = [] {
        const std::string d = subdir("hf_index");
        const auto halves = tiny_hf_halves();
        write_file(d + "/config.json", tiny_config_json());
        write_file(d + "/" + kShard1, safetensors_of(halves.first, "F32"));
        write_file(d + "/" + kShard2, safetensors_of(halves.second, "BF16"));
        return d;
    }();
    return dir;
}

void run_hf_index(const std::string& in) {
    const std::string& dir = hf_index_dir();
    write_file(dir + "/model.safetensors.index.json", in);
    const ModelInfo info = probe_model(dir);
    load_model_params(dir, info);
}

Seeds seeds_hf_index() {
    const auto halves = tiny_hf_halves();
    nlohmann::json index;
    index["metadata"] = {{"total_size", 1234}};
    for (const HfTensor& t : halves.first) index["weight_map"][t.name] = kShard1;
    for (const HfTensor& t : halves.second) index["weight_map"][t.name] = kShard2;
    nlohmann::json missing = index;
    missing["weight_map"]["transformer.ln_f.bias"] = "model-00003-of-00003.safetensors";
    nlohmann::json wrong = index;
    wrong["weight_map"]["transformer.wte.weight"] = kShard2;
    return {{"index.json", index.dump(2)},
            {"bad_missing_shard.json", missing.dump()},
            {"bad_wrong_shard.json", wrong.dump()},
            {"bad_not_object.json", R"({"weight_map": ["model.safetensors"]})"}};
}

// hf_config -----------------------------------------------------------------------------------------

const std::string& hf_config_dir() {
    static const std::string dir = [] {
        const std::string d = subdir("hf_config");
        write_file(d + "/model.safetensors", safetensors_of(tiny_hf_tensors(), "F32"));
        return d;
    }();
    return dir;
}

void run_hf_config(const std::string& in) {
    const std::string& dir = hf_config_dir();
    write_file(dir + "/config.json", in);
    const ModelInfo info = probe_model(dir);
    load_model_params(dir, info);
}

Seeds seeds_hf_config() {
    nlohmann::json transformers = hf_config_json(tiny(), "float32");
    transformers["n_inner"] = 16;
    transformers["activation_function"] = "gelu_pytorch_tanh";
    transformers["_name_or_path"] = "gpt2";
    transformers["task_specific_params"] = {{"text-generation", {{"do_sample", true}, {"max_length", 50}}}};
    nlohmann::json bert = hf_config_json(tiny(), "float32");
    bert["model_type"] = "bert";
    nlohmann::json other_shape = hf_config_json(tiny(), "float32");
    other_shape["n_layer"] = 3;
    std::string overflow = tiny_config_json();
    overflow.replace(overflow.find("0.02"), 4, "1e999");
    return {{"config.json", tiny_config_json()},
            {"transformers.json", transformers.dump(2)},
            {"bad_model_type.json", bert.dump()},
            {"bad_shape.json", other_shape.dump()},
            {"bad_initializer_range_1e999.json", overflow},
            {"bad_epsilon.json", R"({"model_type":"gpt2","n_layer":2,"n_head":2,"n_embd":4,"n_positions":3,)"
                                 R"("vocab_size":5,"layer_norm_epsilon":1e-6})"}};
}

// model_file ----------------------------------------------------------------------------------------

void run_model_file(const std::string& in) {
    const std::string path = write_file(scratch() + "/model.bin", in);
    const ModelInfo info = probe_model(path);
    load_model_params(path, info);
}

Seeds seeds_model_file() {
    auto model = [](int version) {
        return written_by([&](const std::string& path) {
            write_model_file(path, tiny(), tiny_params().data(), version);
        });
    };
    const std::string v3 = model(kModelVersionFp32), v5 = model(kModelVersionBf16);
    // header[7] = 0: read as unpadded (Vp = V), so the file holds V rows of wte.
    GPT2Config unpadded = tiny();
    unpadded.padded_vocab_size = unpadded.vocab_size;
    std::vector<float> params(size_t(num_parameters(unpadded)));
    init_parameters(unpadded, 2, params.data());
    std::string v3_unpadded = written_by([&](const std::string& path) {
        write_model_file(path, unpadded, params.data(), kModelVersionFp32);
    });
    std::memset(&v3_unpadded[7 * 4], 0, 4);
    std::string old = v3;
    const int32_t two = 2;
    std::memcpy(&old[4], &two, 4);
    std::string padded_row = v3;
    const float one = 1.0f;
    std::memcpy(&padded_row[size_t(kModelHeaderBytes) + size_t(tiny().vocab_size) * 4 * 4], &one, 4);
    std::string nan = v3;
    const float q = NAN;
    std::memcpy(&nan[size_t(kModelHeaderBytes) + size_t(param_tensors(tiny())[kWpe].offset) * 4], &q, 4);
    return {{"v3.bin", v3},
            {"v5.bin", v5},
            {"v3_unpadded.bin", v3_unpadded},
            {"bad_v5_truncated.bin", v5.substr(0, v5.size() - 2)},
            {"bad_version2.bin", old},
            {"bad_padded_row.bin", padded_row},
            {"bad_nan.bin", nan}};
}

// shard ---------------------------------------------------------------------------------------------

void run_shard(const std::string& in) {
    const std::string path = write_file(scratch() + "/shard.bin", in);
    {
        File f(path, File::Mode::Read);
        read_shard_header(f);
    }
    // 16-bit tokens to the batch (GPT-2's vocabulary), then 32-bit ones (a larger vocabulary).
    for (uint32_t vocab : {uint32_t(kGPT2VocabSize), 100000u}) {
        DataLoaderConfig cfg;
        cfg.pattern = path;
        cfg.B = 2;
        cfg.T = 3;
        cfg.vocab_size = vocab;
        cfg.seed = 5;
        cfg.prefetch = 0;
        DataLoader loader(cfg);
        const uint64_t batches = std::min<uint64_t>(loader.schedule().batches_per_epoch() + 1, 64);
        for (uint64_t b = 0; b < batches; b++) loader.next();
        loader.restore(loader.state());
        loader.next();
    }
}

Seeds seeds_shard() {
    std::vector<uint32_t> tokens(40);
    for (size_t i = 0; i < tokens.size(); i++) tokens[i] = uint32_t(i * 1237 % 50257);
    auto shard = [&](int version) {
        return written_by([&](const std::string& path) {
            write_token_shard(path, tokens.data(), tokens.size(), version);
        });
    };
    const std::string v1 = shard(1), v2 = shard(2);
    std::string big_id = v2;
    const uint32_t id = 70000;
    std::memcpy(&big_id[size_t(kShardHeaderBytes) + 4 * 5], &id, 4);
    std::string v1_high = v1;
    const uint16_t high = 60000;
    std::memcpy(&v1_high[size_t(kShardHeaderBytes) + 2 * 7], &high, 2);
    std::string v1_vocab = v1;
    const uint16_t vocab = uint16_t(kGPT2VocabSize);
    std::memcpy(&v1_vocab[size_t(kShardHeaderBytes) + 2 * 39], &vocab, 2);
    std::string count_high = v2;
    const int32_t one = 1;
    std::memcpy(&count_high[12], &one, 4);
    return {{"v1.bin", v1},
            {"v2.bin", v2},
            {"bad_v2_id_above_65535.bin", big_id},
            {"bad_v1_id_above_vocab.bin", v1_high},
            {"bad_v1_id_equal_vocab.bin", v1_vocab},
            {"bad_v1_truncated.bin", v1.substr(0, v1.size() - 1)},
            {"bad_v2_count_high_bits.bin", count_high},
            {"bad_too_few_tokens.bin", written_by([&](const std::string& path) {
                 write_token_shard(path, tokens.data(), 5, 1);
             })}};
}

// eval ----------------------------------------------------------------------------------------------

void run_eval(const std::string& in) {
    const std::string path = write_file(scratch() + "/eval.bin", in);
    const McSet set = read_mc_file(path, kGPT2VocabSize);
    const int64_t n = int64_t(set.items.size());
    McBatcher batcher(set, 0, n, 4, 16, 1, kGPT2VocabSize);
    McBatch b;
    while (batcher.next(b)) {
    }
    for (bool share : {true, false}) {
        McPackedBatcher packed(set, 0, n, 16, 4, kGPT2VocabSize, 64, share);
        McPackedBatch pb;
        while (packed.next(pb)) {
        }
    }
    mc_score(set, std::vector<double>(size_t(mc_first_rows(set).back()), 0.0));
}

McSet tiny_eval_set() {
    McSet set{"seed", {}};
    set.items.push_back({{10, 11, 12}, {{1, 2}, {3}, {4, 5, 6}, {7}}, 2});
    set.items.push_back({{20}, {{21}, {22, 23}}, 0});
    set.items.push_back({std::vector<int32_t>(20, 30), {std::vector<int32_t>(15, 31), {32}, {33, 34}}, 1});
    return set;
}

Seeds seeds_eval() {
    const std::string good = written_by([](const std::string& path) { write_mc_file(path, tiny_eval_set()); });
    std::string delimiter = good;
    delimiter[size_t(kMcHeaderBytes)] = 0;
    std::string label = good;
    label[size_t(kMcHeaderBytes) + 6] = 9;
    return {{"set.bin", good},
            {"bad_delimiter.bin", delimiter},
            {"bad_label.bin", label},
            {"bad_truncated.bin", good.substr(0, good.size() - 2)}};
}

// tokenizer -----------------------------------------------------------------------------------------

void run_tokenizer(const std::string& in) {
    read_tokenizer_bin(write_file(scratch() + "/tokenizer.bin", in));
}

Seeds seeds_tokenizer() {
    std::vector<std::string> tokens;
    for (int b = 0; b < 256; b += 37) tokens.push_back(std::string(1, char(b)));
    tokens.push_back("hello");
    tokens.push_back("<|endoftext|>");
    const Tokenizer tok(tokens, uint32_t(tokens.size() - 1));
    const std::string v2 = written_by([&](const std::string& path) { write_tokenizer_bin(tok, path); });
    std::string v1 = v2;
    const uint32_t one = 1;
    std::memcpy(&v1[4], &one, 4);
    std::string long_token = v2;
    long_token[size_t(kTokenizerHeaderInts) * 4] = char(200);
    return {{"v2.bin", v2},
            {"bad_v1_small_vocabulary.bin", v1},
            {"bad_token_length.bin", long_token},
            {"bad_trailing.bin", v2 + "x"}};
}

// manifest ------------------------------------------------------------------------------------------

// A checkpoint of the tiny model at step 10 whose files hold both layouts' arrays (whole: model.bin,
// params_bf16.bin, adam_m.bin, adam_v.bin; sharded over two ranks: master_, adam_m_, adam_v_<rank>.bin),
// checksummed in chunks of 1000 bytes, and the DataLoader the trainer would restore into.
constexpr int64_t kCkptStep = 10;
constexpr size_t kCkptChunk = 1000;

struct CheckpointFixture {
    std::string dir;
    int64_t params = 0;
    std::vector<FileRecord> files;
    std::unique_ptr<SampleSchedule> schedule;
};

std::string fixture_file_bytes(const std::string& name, int64_t n) {
    if (name == kCkptModelFile) {
        return written_by([&](const std::string& path) {
            write_model_file(path, tiny(), tiny_params().data(), kModelVersionFp32);
        });
    }
    const size_t bytes = size_t(n) * (name == kCkptParamsFile ? 2 : 4);
    std::string s(bytes, '\0');
    for (size_t i = 0; i < bytes; i++) s[i] = char((i * 131 + name.size() * 7) & 0xff);
    return s;
}

const CheckpointFixture& checkpoint_fixture() {
    static const CheckpointFixture fx = [] {
        CheckpointFixture f;
        f.params = num_parameters(tiny());
        f.dir = subdir("out") + "/" + checkpoint_dir_name(kCkptStep);
        make_directories(f.dir);
        const int64_t half = f.params / 2;
        std::vector<std::pair<std::string, int64_t>> names = {
            {kCkptModelFile, f.params}, {kCkptParamsFile, f.params},
            {kCkptAdamMFile, f.params}, {kCkptAdamVFile, f.params}};
        for (int r = 0; r < 2; r++) {
            for (StateKind k : {StateKind::Master, StateKind::AdamM, StateKind::AdamV}) {
                names.push_back({state_shard_file(k, r), r == 0 ? half : f.params - half});
            }
        }
        for (const auto& [name, n] : names) {
            const std::string bytes = fixture_file_bytes(name, n);
            write_file(f.dir + "/" + name, bytes);
            FileRecord rec;
            rec.name = name;
            rec.size = bytes.size();
            for (size_t at = 0; at < bytes.size(); at += kCkptChunk) {
                const size_t len = std::min(kCkptChunk, bytes.size() - at);
                rec.chunks.push_back({at, len, checksum64(bytes.data() + at, len)});
            }
            f.files.push_back(rec);
        }
        std::vector<uint32_t> tokens(200);
        for (size_t i = 0; i < tokens.size(); i++) tokens[i] = uint32_t(i * 7919 % 50257);
        const std::string shard = scratch() + "/train_000000.bin";
        write_token_shard(shard, tokens.data(), tokens.size(), 1);
        DataLoaderConfig cfg;
        cfg.pattern = shard;
        cfg.B = 2;
        cfg.T = 8;
        cfg.vocab_size = kGPT2VocabSize;
        cfg.seed = 3;
        cfg.prefetch = 0;
        f.schedule = std::make_unique<SampleSchedule>(cfg);
        return f;
    }();
    return fx;
}

// A DataLoader state blob with its last 8 bytes set to the checksum of the others.
std::vector<uint8_t> with_state_checksum(std::vector<uint8_t> blob) {
    if (blob.size() < 20) return blob;
    const uint64_t sum = fnv1a64(blob.data(), blob.size() - 8);
    for (int i = 0; i < 8; i++) blob[blob.size() - 8 + size_t(i)] = uint8_t(sum >> (8 * i));
    return blob;
}

void run_manifest(const std::string& in) {
    const CheckpointFixture& fx = checkpoint_fixture();
    const std::string path = fx.dir + "/" + kManifestName;
    attempt([&] { parse_manifest(in, path); });  // as it came, so that the checksum and 'end' checks are fuzzed too
    write_file(path, in + "end " + format("%016llx", (unsigned long long)checksum64(in.data(), in.size())) + "\n");
    const CheckpointManifest m = validate_checkpoint(fx.dir, /*deep=*/true);
    if (const std::vector<uint8_t>* blob = m.blob("train_loader")) {
        // As it came, then with its checksum made right, so that the fields behind the checksum are fuzzed too.
        const std::vector<uint8_t> fixed = with_state_checksum(*blob);
        for (const std::vector<uint8_t>* b : {blob, &fixed}) {
            attempt([&] {
                SampleSchedule::state_world(*b);
                fx.schedule->decode_state(*b, /*allow_world_change=*/true);
            });
        }
    }
    if (const std::vector<uint8_t>* blob = m.blob("step_guard")) {
        RunControl guard(RunControl::Limits{}, std::chrono::steady_clock::now());
        attempt([&] { guard.restore(*blob, fx.dir); });
    }
    const StateLayout layout = read_state_layout(fx.dir, m, fx.params);
    std::vector<char> array(size_t(fx.params) * 4);
    auto read = [&](const std::vector<ArraySegment>& segments, size_t elem_bytes) {
        read_array_range(fx.dir, m, segments, elem_bytes, 0, fx.params, [&](uint64_t at, const char* p, size_t n) {
            if (at > array.size() / 4 * elem_bytes || n > array.size() / 4 * elem_bytes - at) {
                finding(format("read_array_range wrote bytes %llu..%llu of a %zu-byte array",
                               (unsigned long long)at, (unsigned long long)(at + n), array.size() / 4 * elem_bytes));
            }
            std::memcpy(array.data() + at, p, n);
        });
    };
    read(layout.master, 4);
    read(layout.adam_m, 4);
    read(layout.adam_v, 4);
    read({layout.params}, 2);
}

Seeds seeds_manifest() {
    const CheckpointFixture& fx = checkpoint_fixture();
    auto manifest = [&](bool sharded) {
        CheckpointManifest m;
        m.step = kCkptStep;
        m.settings = {{"model", "d2"}, {"batch_size", "2"}, {"seq_len", "8"}, {"seed", "3"}};
        const int64_t half = fx.params / 2;
        if (sharded) {
            m.settings.push_back({"state_layout", "sharded"});
            m.settings.push_back({"state_ranks", "2"});
            m.settings.push_back({"state_shard_0", format("0 %lld", (long long)half)});
            m.settings.push_back(
                {"state_shard_1", format("%lld %lld", (long long)half, (long long)(fx.params - half))});
        } else {
            m.settings.push_back({"state_layout", "whole"});
        }
        m.blobs.push_back({"train_loader", fx.schedule->encode_state(sharded ? 7 : 2)});
        RunControl guard(RunControl::Limits{}, std::chrono::steady_clock::now());
        guard.after_step(1, 3.5, "");
        guard.after_step(2, 3.25, "");
        m.blobs.push_back({"step_guard", guard.state()});
        for (const FileRecord& f : fx.files) {
            const bool shard_file = f.name.find("_0000") != std::string::npos;
            if (f.name == kCkptModelFile || shard_file == sharded) m.files.push_back(f);
        }
        const std::string text = encode_manifest(m);
        return text.substr(0, text.rfind("end "));  // the target appends the 'end' line
    };
    const std::string whole = manifest(false), sharded = manifest(true);
    std::string overlap = sharded;
    const size_t at = overlap.find("state_shard_1 ") + std::strlen("state_shard_1 ");
    overlap[at] = char(overlap[at] - 1);
    return {{"whole.txt", whole},
            {"sharded.txt", sharded},
            {"bad_shard_ranges.txt", overlap},
            {"bad_chunk_gap.txt", whole.substr(0, whole.rfind("chunk "))},
            {"bad_no_files.txt", "llmc-checkpoint 1\nstep 10\nsetting state_layout whole\nblob train_loader -\n"}};
}

// jsonl ---------------------------------------------------------------------------------------------

// One call per line that is not blank, as prepare_data and prepare_eval read their JSONL: the reader never
// sees a newline.
template <class Fn>
void for_each_line(const std::string& in, Fn&& fn) {
    size_t start = 0;
    for (long long line_no = 1; start <= in.size(); line_no++) {
        const size_t end = std::min(in.find('\n', start), in.size());
        const std::string_view line = std::string_view(in).substr(start, end - start);
        if (line.find_first_not_of(" \t\r") != std::string_view::npos) fn(line, line_no);
        start = end + 1;
    }
}

void run_jsonl(const std::string& in) {
    for_each_line(in, [](std::string_view line, long long line_no) {
        jsonl_document_text(line, "input.jsonl", line_no, "text");
    });
}

Seeds seeds_jsonl() {
    return {{"text.jsonl", "{\"text\": \"Hello, world.\"}"},
            {"fields.jsonl", R"({"id": 7, "text": "caf\u00e9 \ud83d\ude00\n\ttab", "meta": {"a": [1, 2.5, null]}})"},
            {"lines.jsonl", "{\"text\": \"one\"}\n{\"text\": \"two\"}\r\n{\"text\": \"\"}"},
            {"bad_not_string.jsonl", "{\"text\": 5}"},
            {"bad_no_text.jsonl", "{\"content\": \"x\"}"},
            {"bad_overflow.jsonl", "{\"text\": \"hello\", \"score\": 1e999}"},
            {"bad_syntax.jsonl", "{\"text\": \"unterminated}"}};
}

// hellaswag, vocab, encoder (PCRE2) ----------------------------------------------------------------

#ifdef LLMC_TOKENIZER_ENCODER
void run_hellaswag(const std::string& in) {
    for_each_line(in, [](std::string_view line, long long line_no) {
        parse_hellaswag_line(std::string(line), "hellaswag.jsonl", line_no);
    });
}

Seeds seeds_hellaswag() {
    return {{"row.jsonl", R"({"ind": 24, "activity_label": "Roof shingle removal",)"
                          R"( "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",)"
                          R"( "ctx": "A man is sitting on a roof. he", "split": "val", "split_type": "indomain",)"
                          R"( "label": 3, "endings": ["is using wrap.", "is ripping level tiles off.",)"
                          R"( "is holding a rubik's cube.", "starts pulling up roofing on a roof."],)"
                          R"( "source_id": "x"})"},
            {"ctx_ab.jsonl", R"({"ctx_a": "A cat", "ctx_b": "sits", "endings": ["a", "b", "c", "d"], "label": "1"})"},
            {"bad_label.jsonl", R"({"ctx": "A", "endings": ["a", "b", "c", "d"], "label": 4})"},
            {"bad_three_endings.jsonl", R"({"ctx": "A", "endings": ["a", "b", "c"], "label": 0})"},
            {"bad_endings.jsonl", R"({"ctx": "A", "endings": "ab", "label": 0})"}};
}

// encoder.json, a NUL byte, vocab.bpe: the two files load_gpt2_vocab_files() reads.
void run_vocab(const std::string& in) {
    const size_t nul = in.find('\0');
    const std::string enc = write_file(scratch() + "/encoder.json", in.substr(0, nul));
    const std::string bpe = write_file(scratch() + "/vocab.bpe", nul == std::string::npos ? "" : in.substr(nul + 1));
    load_gpt2_vocab_files(enc, bpe);
}

Seeds seeds_vocab() {
    // GPT-2's byte alphabet as encoder.json spells it, three merges and <|endoftext|>.
    const auto& cp = gpt2_byte_to_codepoint();
    auto utf8 = [](uint32_t c) {
        return c < 0x80 ? std::string(1, char(c)) : std::string{char(0xC0 | (c >> 6)), char(0x80 | (c & 0x3F))};
    };
    nlohmann::json enc = nlohmann::json::object();
    for (int b = 0; b < 256; b++) enc[utf8(cp[size_t(b)])] = b;
    enc["he"] = 256;
    enc["ll"] = 257;
    enc["hell"] = 258;
    enc["<|endoftext|>"] = 259;
    const std::string merges = "#version: 0.2\nh e\nl l\nhe ll\n";
    std::string unordered = "#version: 0.2\nh e\nhe ll\nl l\n";
    return {{"vocab.txt", enc.dump() + std::string(1, '\0') + merges},
            {"bad_merge_order.txt", enc.dump() + std::string(1, '\0') + unordered},
            {"bad_missing_byte.txt", R"({"a": 0, "<|endoftext|>": 1})" + std::string(1, '\0') + merges}};
}

// GPT-2's vocabulary and its encoder, from FUZZ_GPT2_DIR or .deps/gpt2.
const Tokenizer* g_gpt2 = nullptr;
const Gpt2Encoder* g_encoder = nullptr;

bool setup_encoder() {
    const std::string dir = std::getenv("FUZZ_GPT2_DIR") ? std::getenv("FUZZ_GPT2_DIR") : ".deps/gpt2";
    if (!regular_file_exists(dir + "/encoder.json") || !regular_file_exists(dir + "/vocab.bpe")) {
        std::fprintf(stderr, "fuzz: target 'encoder' needs GPT-2's encoder.json and vocab.bpe in %s (bash "
                     "scripts/setup.sh, or set FUZZ_GPT2_DIR)\n", dir.c_str());
        return false;
    }
    static const Tokenizer gpt2 = load_gpt2_vocab_files(dir + "/encoder.json", dir + "/vocab.bpe");
    static const Gpt2Encoder encoder(gpt2);
    g_gpt2 = &gpt2;
    g_encoder = &encoder;
    return true;
}

void run_encoder(const std::string& in) {
    static Gpt2Encoder::Context ctx(*g_encoder);
    const std::vector<uint32_t> ids = g_encoder->encode_ordinary(ctx, in);
    if (g_gpt2->decode(ids.data(), ids.size()) != in) finding("decode(encode(x)) differs from x");
    const size_t cut = safe_split_point(in, in.size() / 2);
    std::vector<uint32_t> parts = g_encoder->encode_ordinary(ctx, std::string_view(in).substr(0, cut));
    g_encoder->encode_ordinary(ctx, std::string_view(in).substr(cut), parts);
    if (parts != ids) {
        finding(format("encoding the text cut at safe_split_point %zu differs from encoding it whole", cut));
    }
}

Seeds seeds_encoder() {
    return {{"ascii.txt", "Hello world, it's 2024!\n\n  The quick brown fox's  jumps.\t\r\n"},
            {"unicode.txt", "caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E "
                            "\xF0\x9F\x98\x80 na\xC3\xAFve\xE2\x80\x83x"},
            {"invalid_utf8.txt", "ab \xFF\xFE cd \xC3 \xE2\x82 ef   \x80"},
            {"spaces.txt", "a  \n\n\n   b    c\t\t d  "}};
}
#endif

const Target kTargets[] = {
    {"safetensors", false, [] { return !safetensors_dir().empty(); }, run_safetensors, seeds_safetensors},
    {"hf_index", true, [] { return !hf_index_dir().empty(); }, run_hf_index, seeds_hf_index},
    {"hf_config", false, [] { return !hf_config_dir().empty(); }, run_hf_config, seeds_hf_config},
    {"model_file", false, nullptr, run_model_file, seeds_model_file},
    {"shard", false, nullptr, run_shard, seeds_shard},
    {"eval", false, nullptr, run_eval, seeds_eval},
    {"tokenizer", false, nullptr, run_tokenizer, seeds_tokenizer},
    {"manifest", true, [] { return !checkpoint_fixture().dir.empty(); }, run_manifest, seeds_manifest},
    {"jsonl", false, nullptr, run_jsonl, seeds_jsonl},
#ifdef LLMC_TOKENIZER_ENCODER
    {"hellaswag", false, nullptr, run_hellaswag, seeds_hellaswag},
    {"vocab", false, nullptr, run_vocab, seeds_vocab},
    {"encoder", false, setup_encoder, run_encoder, seeds_encoder},
#endif
};

bool g_verbose = false;  // FUZZ_VERBOSE=1: say why each input was refused (for replaying a few by hand)

std::string target_names() {
    std::string s;
    for (const Target& t : kTargets) s += (s.empty() ? "" : " ") + std::string(t.name);
    return s;
}

// Writes t's seeds to dir/<t>/, each checked first where the target can run: refused as the README says
// (wrong_refusal) when its name starts "bad_", else accepted; exit code 1 when one is not.
void write_seeds(const std::string& dir, const Target& t) {
    g_target = &t;
    const bool check = !t.setup || t.setup();
    const std::string d = dir + "/" + t.name;
    make_directories(d);
    for (const auto& [name, bytes] : t.seeds()) {
        if (!check) {
            write_file(d + "/" + name, bytes);
            continue;
        }
        std::string refused, wrong;
        try {
            t.run(bytes);
        } catch (const Error& e) {
            refused = e.what();
            wrong = wrong_refusal(t, e);
        }
        if (refused.empty() == (name.rfind("bad_", 0) == 0) || !wrong.empty()) {
            std::fprintf(stderr, "fuzz: seed %s/%s was %s\n", t.name, name.c_str(),
                         refused.empty() ? "accepted" : ("refused: " + (wrong.empty() ? refused : wrong)).c_str());
            std::exit(1);
        }
        write_file(d + "/" + name, bytes);
    }
    std::printf("%s: seeds written to %s%s\n", t.name, d.c_str(), check ? "" : " (not checked)");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    const char* name = std::getenv("FUZZ_TARGET");
    const char* seeds = std::getenv("FUZZ_WRITE_SEEDS");
    if (name && std::strcmp(name, "list") == 0) {
        for (const Target& t : kTargets) std::printf("%s\n", t.name);
        std::exit(0);
    }
    for (const Target& t : kTargets) {
        if (name && std::strcmp(name, t.name) == 0) g_target = &t;
    }
    if (seeds && !name) {
        for (const Target& t : kTargets) write_seeds(seeds, t);
        std::exit(0);
    }
    if (!g_target) {
        std::fprintf(stderr, "fuzz: %s; set FUZZ_TARGET to one of: %s (or list)\n",
                     name ? format("unknown target '%s'", name).c_str() : "FUZZ_TARGET is not set",
                     target_names().c_str());
        std::exit(2);
    }
    if (seeds) {
        write_seeds(seeds, *g_target);
        std::exit(0);
    }
    if (g_target->setup && !g_target->setup()) std::exit(77);  // scripts/fuzz.sh reports the target as skipped
    g_verbose = std::getenv("FUZZ_VERBOSE") && std::strcmp(std::getenv("FUZZ_VERBOSE"), "1") == 0;
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    try {
        g_target->run(std::string(reinterpret_cast<const char*>(data), size));
    } catch (const Error& e) {
        const std::string wrong = wrong_refusal(*g_target, e);
        if (!wrong.empty()) finding(wrong);
        if (g_verbose) std::fprintf(stderr, "fuzz: refused with exit code %d: %s\n", e.exit_code(), e.what());
    }
    return 0;
}
