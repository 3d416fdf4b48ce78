/*
CPU tests of model input and output: safetensors (llmc/safetensors.h), Hugging Face GPT-2 folders
(llmc/hf_model.h), llm.c model files written as version 3 and 5 (llmc/model_file.h), and the entry
points both trainers use (llmc/model_io.h).

Covered: safetensors written and read back (F32, BF16, empty and scalar tensors, values written across
tensor boundaries, the 8-byte-padded header and its metadata); fp16 -> fp32 for every half value; every
malformed-header case refused with exit code 4 and the file and tensor named, JSON that nlohmann alone
would accept or throw on (a NUL byte, a key twice at any depth, a number beyond double's range) in
headers, config.json and the shard index among them; Hugging Face folders
whose Conv1D weights are checked element by element against our layout, round trips (llm.c v3 ->
folder -> v3 and v5 -> bf16 folder -> v5 byte for byte, folder -> v3 -> folder with the same tensors),
sharded folders, names without the "transformer." prefix, tied lm_head, ignored attention-mask
buffers, and the refusal of what our GPT-2 cannot compute (config keys, untied or unknown tensors,
wrong shapes and dtypes, a changed folder, NaN or infinite weights in every format); the tokenizer
files of an export; the path errors ("does not exist", "is a directory", a link loop, a FIFO).
PyTorch- and numpy-side checks, and the converter's command-line errors, are in
test/test_model_io_torch.sh.
*/
#include <gtest/gtest.h>

#include <csignal>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "llmc/dataloader.h"
#include "llmc/model_io.h"
#include "llmc/safetensors.h"
#include "test/expect_error.h"
#include "test/test_util.h"

using namespace llmc;
using llmc::test::TempDir;
using json = nlohmann::json;

namespace {

// A small model whose every size differs (V=67 pads to Vp=128; maxT=11), so a transposition or an
// offset mistake cannot hide behind a square or repeated shape.
GPT2Config tiny_config() { return make_config(2, 24, 3, 67, 11); }

// Random values in every tensor (LayerNorms and biases too), padded vocabulary rows zero.
std::vector<float> random_params(const GPT2Config& c, uint64_t seed) {
    std::vector<float> p(size_t(num_parameters(c)));
    SplitMix64 rng(seed);
    for (float& x : p) x = float(int64_t(rng.next() >> 40) - (int64_t(1) << 23)) * 0x1p-24f;
    const int64_t C = c.channels;
    std::fill(p.begin() + int64_t(c.vocab_size) * C, p.begin() + int64_t(c.padded_vocab_size) * C, 0.0f);
    return p;
}

std::string slurp(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
}

void spit(const std::string& path, const std::string& bytes) {
    std::ofstream f(path, std::ios::binary);
    f.write(bytes.data(), std::streamsize(bytes.size()));
}

// A safetensors file from a header text and data bytes, exactly as given (no checks).
void raw_safetensors(const std::string& path, const std::string& header, const std::string& data,
                     uint64_t length_field = UINT64_MAX) {
    uint64_t n = length_field == UINT64_MAX ? header.size() : length_field;
    std::string bytes(reinterpret_cast<const char*>(&n), 8);
    spit(path, bytes + header + data);
}

std::vector<float> read_tensor(const SafetensorsFile& f, const std::string& name) {
    const SafetensorsTensor& t = f.require(name);
    std::vector<float> v(size_t(t.numel));
    f.read_floats(t, v.data());
    return v;
}

// One Hugging Face tensor, built from our flat parameters by index arithmetic written out here (not
// hf_model.h's transpose), so that the layout is checked against an independent statement of it.
struct NamedTensor {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> values;
};

std::vector<NamedTensor> hf_tensors_by_hand(const GPT2Config& c, const std::vector<float>& p,
                                            const std::string& prefix = "transformer.") {
    const int64_t C = c.channels, L = c.num_layers, V = c.vocab_size, maxT = c.max_seq_len;
    const auto t = param_tensors(c);
    std::vector<NamedTensor> out;
    auto slice = [&](int kind, int64_t l, int64_t n) {
        const float* base = p.data() + t[size_t(kind)].offset + l * n;
        return std::vector<float>(base, base + n);
    };
    // Ours (L, out, in) -> Hugging Face (in, out) for layer l.
    auto conv1d = [&](int kind, int64_t l, int64_t out_dim, int64_t in_dim) {
        std::vector<float> v(size_t(out_dim * in_dim));
        const float* w = p.data() + t[size_t(kind)].offset + l * out_dim * in_dim;
        for (int64_t i = 0; i < in_dim; i++) {
            for (int64_t o = 0; o < out_dim; o++) v[size_t(i * out_dim + o)] = w[o * in_dim + i];
        }
        return v;
    };
    out.push_back({prefix + "wte.weight", {V, C}, slice(kWte, 0, V * C)});
    out.push_back({prefix + "wpe.weight", {maxT, C}, slice(kWpe, 0, maxT * C)});
    for (int64_t l = 0; l < L; l++) {
        std::string h = prefix + "h." + std::to_string(l) + ".";
        out.push_back({h + "ln_1.weight", {C}, slice(kLn1w, l, C)});
        out.push_back({h + "ln_1.bias", {C}, slice(kLn1b, l, C)});
        out.push_back({h + "attn.c_attn.weight", {C, 3 * C}, conv1d(kQkvw, l, 3 * C, C)});
        out.push_back({h + "attn.c_attn.bias", {3 * C}, slice(kQkvb, l, 3 * C)});
        out.push_back({h + "attn.c_proj.weight", {C, C}, conv1d(kAttprojw, l, C, C)});
        out.push_back({h + "attn.c_proj.bias", {C}, slice(kAttprojb, l, C)});
        out.push_back({h + "ln_2.weight", {C}, slice(kLn2w, l, C)});
        out.push_back({h + "ln_2.bias", {C}, slice(kLn2b, l, C)});
        out.push_back({h + "mlp.c_fc.weight", {C, 4 * C}, conv1d(kFcw, l, 4 * C, C)});
        out.push_back({h + "mlp.c_fc.bias", {4 * C}, slice(kFcb, l, 4 * C)});
        out.push_back({h + "mlp.c_proj.weight", {4 * C, C}, conv1d(kFcprojw, l, C, 4 * C)});
        out.push_back({h + "mlp.c_proj.bias", {C}, slice(kFcprojb, l, C)});
    }
    out.push_back({prefix + "ln_f.weight", {C}, slice(kLnfw, 0, C)});
    out.push_back({prefix + "ln_f.bias", {C}, slice(kLnfb, 0, C)});
    return out;
}

void write_tensors(const std::string& path, const std::vector<NamedTensor>& tensors, const std::string& dtype = "F32") {
    std::vector<SafetensorsSpec> specs;
    for (const NamedTensor& t : tensors) specs.push_back({t.name, dtype, t.shape});
    SafetensorsWriter w(path, specs);
    for (const NamedTensor& t : tensors) w.write(t.values.data(), int64_t(t.values.size()));
    w.finish();
}

// A Hugging Face folder written by hand: config.json from hf_config_json (optionally edited) and one
// model.safetensors of the given tensors.
void write_folder(const std::string& dir, const GPT2Config& c, const std::vector<NamedTensor>& tensors,
                  const json& config_edits = json::object()) {
    std::filesystem::create_directories(dir);
    json config = hf_config_json(c, "float32");
    for (auto& [k, v] : config_edits.items()) {
        if (v.is_string() && v == "<erase>") config.erase(k);
        else config[k] = v;
    }
    spit(dir + "/config.json", config.dump(2));
    write_tensors(dir + "/model.safetensors", tensors);
}

std::vector<float> load(const std::string& path) { return load_model_params(path, probe_model(path)); }

// ----------------------------------------------------------------------------------------------------
// Safetensors

TEST(Safetensors, WrittenFileReadsBackWithPaddedHeaderAndMetadata) {
    TempDir dir("st_rt");
    const std::string path = dir / "t.safetensors";
    std::vector<SafetensorsSpec> specs = {
        {"a", "F32", {3, 5}},  {"empty", "F32", {0, 7}}, {"b", "BF16", {13}},
        {"scalar", "F32", {}}, {"c", "F32", {2, 1, 3}}};
    std::vector<float> values(15 + 13 + 1 + 6);
    SplitMix64 rng(7);
    for (float& v : values) v = float(int64_t(rng.next() >> 33) - (int64_t(1) << 30)) * 0x1p-20f;
    {
        SafetensorsWriter w(path, specs);
        // Pieces that end inside tensors and span several, to test the writer's bookkeeping.
        w.write(values.data(), 4);
        w.write(values.data() + 4, 20);
        w.write(values.data() + 24, int64_t(values.size()) - 24);
        w.finish();
    }
    std::string bytes = slurp(path);
    uint64_t n;
    std::memcpy(&n, bytes.data(), 8);
    EXPECT_EQ(n % 8, 0u);
    EXPECT_EQ(bytes[8], '{');

    SafetensorsFile f(path);
    ASSERT_EQ(f.tensors().size(), 5u);
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_EQ(f.data_offset(), int64_t(8 + n));
    EXPECT_EQ(f.require("a").shape, (std::vector<int64_t>{3, 5}));
    EXPECT_EQ(f.require("empty").numel, 0);
    EXPECT_EQ(f.require("scalar").numel, 1);
    EXPECT_EQ(f.require("b").dtype, "BF16");
    EXPECT_EQ(read_tensor(f, "a"), std::vector<float>(values.begin(), values.begin() + 15));
    std::vector<float> b = read_tensor(f, "b");
    for (int i = 0; i < 13; i++) EXPECT_EQ(b[size_t(i)], bf16_to_float(float_to_bf16(values[size_t(15 + i)])));
    EXPECT_EQ(read_tensor(f, "scalar"), std::vector<float>{values[28]});
    EXPECT_EQ(read_tensor(f, "c"), std::vector<float>(values.begin() + 29, values.end()));
    EXPECT_EQ(int64_t(bytes.size()), f.data_offset() + (15 + 1 + 6) * 4 + 13 * 2);
}

TEST(Safetensors, WriterRefusesTooManyOrTooFewValues) {
    TempDir dir("st_count");
    std::vector<float> v(10, 1.0f);
    {
        SafetensorsWriter w(dir / "a.safetensors", {{"x", "F32", {4}}});
        expect_error([&] { w.write(v.data(), 5); }, kExitUsage, {"more values"});
    }
    SafetensorsWriter w(dir / "b.safetensors", {{"x", "F32", {4}}, {"y", "BF16", {2}}});
    w.write(v.data(), 5);
    expect_error([&] { w.finish(); }, kExitUsage, {"'y'", "1 of its 2"});
    expect_error([&] { SafetensorsWriter bad(dir / "c.safetensors", {{"x", "I64", {4}}}); }, kExitUsage, {"I64"});
}

TEST(Safetensors, Fp16ToFloatIsExactForEveryHalfValue) {
    EXPECT_EQ(fp16_to_float(0x3c00), 1.0f);
    EXPECT_EQ(fp16_to_float(0xc000), -2.0f);
    EXPECT_EQ(fp16_to_float(0x7bff), 65504.0f);
    EXPECT_EQ(fp16_to_float(0x0001), std::ldexp(1.0f, -24));
    EXPECT_EQ(fp16_to_float(0x03ff), 1023 * std::ldexp(1.0f, -24));
    EXPECT_EQ(fp16_to_float(0x0400), std::ldexp(1.0f, -14));
    EXPECT_TRUE(std::signbit(fp16_to_float(0x8000)) && fp16_to_float(0x8000) == 0.0f);
    EXPECT_EQ(fp16_to_float(0x7c00), INFINITY);
    EXPECT_EQ(fp16_to_float(0xfc00), -INFINITY);
    EXPECT_TRUE(std::isnan(fp16_to_float(0x7e00)));
    EXPECT_TRUE(std::isnan(fp16_to_float(0xfc01)));
    // Every finite half: value = (-1)^s * 2^(e-15) * (1 + m/1024), or 2^-14 * m/1024 when e = 0.
    for (uint32_t h = 0; h < 65536; h++) {
        const uint32_t e = (h >> 10) & 31, m = h & 1023;
        if (e == 31) continue;
        double mag = e == 0 ? std::ldexp(double(m) / 1024.0, -14) : std::ldexp(1.0 + double(m) / 1024.0, int(e) - 15);
        double expected = (h & 0x8000) ? -mag : mag;
        ASSERT_EQ(double(fp16_to_float(uint16_t(h))), expected) << "half 0x" << std::hex << h;
    }
}

TEST(Safetensors, ReadsF16AndBf16Tensors) {
    TempDir dir("st_half");
    const uint16_t f16[3] = {0x3c00, 0xb800, 0x0001};  // 1, -0.5, 2^-24
    const uint16_t bf16[2] = {0x3f80, 0xc040};         // 1, -3
    std::string data(reinterpret_cast<const char*>(f16), 6);
    data += std::string(reinterpret_cast<const char*>(bf16), 4);
    raw_safetensors(dir / "h.safetensors",
                    R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[0,6]},)"
                    R"("b":{"dtype":"BF16","shape":[1,2],"data_offsets":[6,10]}})",
                    data);
    SafetensorsFile f(dir / "h.safetensors");
    EXPECT_EQ(read_tensor(f, "h"), (std::vector<float>{1.0f, -0.5f, std::ldexp(1.0f, -24)}));
    EXPECT_EQ(read_tensor(f, "b"), (std::vector<float>{1.0f, -3.0f}));
    EXPECT_TRUE(f.metadata().empty());
}

struct BadHeader {
    const char* what;
    std::string header;
    std::string data;
    std::vector<std::string> message;  // fragments, besides the file name
    uint64_t length_field = UINT64_MAX;
};

TEST(Safetensors, MalformedHeadersAreRefusedNamingFileAndTensor) {
    TempDir dir("st_bad");
    const std::string ok_entry = R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})";
    const std::string d16(16, '\1');
    const std::vector<BadHeader> cases = {
        {"length past the end", "{}", "", {"header length 4096", "past the end"}, 4096},
        // Past the file by less than the 8 bytes of the length field itself: still the header's fault.
        {"length past the end by 8", "{}", "", {"header length 10", "past the end of the 10-byte file"}, 10},
        {"length absurd", "{}", "", {"header length", "not in [2, 100000000]"}, uint64_t(1) << 40},
        {"length zero", "{}", "", {"header length 0"}, 0},
        {"not JSON", R"({"w":{"dtype":"F32",)", d16, {"not valid JSON at offset 28"}},
        {"number overflow", R"({"w":{"dtype":"F32","shape":[1e999],"data_offsets":[0,16]}})", d16,
         {"tensor 'w', key 'shape'", "number overflow parsing '1e999'"}},
        // nlohmann stops reading at a NUL; the reference reader refuses the header.
        {"NUL padding", "{" + ok_entry + "}" + std::string(6, '\0'), d16, {"NUL byte at offset 65"}},
        {"NUL then more", "{" + ok_entry + std::string(1, '\0') + R"(,"v":1})", d16, {"NUL byte at offset 64"}},
        {"not an object", "[1,2]", "", {"does not start with '{'"}},
        {"entry not an object", R"({"w":[1]})", "", {"tensor 'w'", "not an object"}},
        {"no dtype", R"({"w":{"shape":[1],"data_offsets":[0,4]}})", d16, {"tensor 'w'", "no 'dtype'"}},
        {"unknown dtype", R"({"w":{"dtype":"F12","shape":[2],"data_offsets":[0,4]}})", d16,
         {"tensor 'w'", "unknown dtype \"F12\""}},
        {"long unknown dtype",
         R"({"w":{"dtype":")" + std::string(5000, 'A') + R"(","shape":[2],"data_offsets":[0,4]}})", d16,
         {"tensor 'w'", "unknown dtype \"AAAA", "AAA..."}},
        {"negative dimension", R"({"w":{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}})", d16,
         {"tensor 'w'", "shape holds -2"}},
        {"fractional dimension", R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,10]}})", d16,
         {"tensor 'w'", "shape holds 2.5"}},
        {"huge shape", R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,16]}})", d16,
         {"tensor 'w'", "too large"}},
        {"offset beyond int64", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,18446744073709551615]}})", d16,
         {"tensor 'w'", "data_offsets holds 18446744073709551615"}},
        {"offset at int64's end",
         R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[9223372036854775807,9223372036854775807]}})", d16,
         {"tensor 'w'", "past the end"}},
        {"shape vs offsets", R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", d16,
         {"tensor 'w'", "needs 24 bytes", "span 16"}},
        {"offsets longer than the shape", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", d16,
         {"tensor 'w'", "needs 8 bytes", "span 16"}},
        {"offsets reversed", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", d16,
         {"tensor 'w'", "end before they begin"}},
        {"offsets past the end", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[4,20]}})", d16,
         {"tensor 'w'", "past the end of the 16-byte data section"}},
        {"one offset", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0]}})", d16,
         {"tensor 'w'", "not [begin, end]"}},
        {"overlap", "{" + ok_entry + R"(,"v":{"dtype":"BF16","shape":[3],"data_offsets":[10,16]}})", d16,
         {"'w' [0, 16]", "'v' [10, 16]", "overlap"}},
        {"duplicate name", "{" + ok_entry + "," + ok_entry + "}", d16, {"tensor 'w' appears twice"}},
        {"duplicate dtype", R"({"w":{"dtype":"I64","dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", d16,
         {"tensor 'w', key 'dtype' appears twice"}},
        {"duplicate metadata key", "{" + ok_entry + R"(,"__metadata__":{"format":"pt","format":"pt"}})", d16,
         {"tensor '__metadata__', key 'format' appears twice"}},
        {"metadata not strings", "{" + ok_entry + R"(,"__metadata__":{"format":1}})", d16,
         {"__metadata__ entry 'format'"}},
    };
    for (const BadHeader& c : cases) {
        SCOPED_TRACE(c.what);
        const std::string path = dir / "bad.safetensors";
        raw_safetensors(path, c.header, c.data, c.length_field);
        std::vector<std::string> parts = c.message;
        parts.push_back(path);
        expect_error([&] { SafetensorsFile f(path); }, kExitData, parts);
    }
    // Spaces after the JSON are the format's padding, not a fault.
    raw_safetensors(dir / "padded.safetensors", "{" + ok_entry + "}     ", d16);
    EXPECT_EQ(SafetensorsFile(dir / "padded.safetensors").require("w").numel, 4);
    spit(dir / "short.safetensors", "abc");
    expect_error([&] { SafetensorsFile f(dir / "short.safetensors"); }, kExitData, {"short.safetensors", "3 bytes"});
}

TEST(Safetensors, TruncatedDataMissingTensorsAndUnreadableDtypesNameTheTensor) {
    TempDir dir("st_trunc");
    const std::string path = dir / "t.safetensors";
    std::vector<float> v(35, 0.5f);
    {
        SafetensorsWriter w(path, {{"first", "F32", {5}}, {"last", "F32", {5, 6}}});
        w.write(v.data(), 35);
        w.finish();
    }
    std::string bytes = slurp(path);
    spit(path, bytes.substr(0, bytes.size() - 3));
    expect_error([&] { SafetensorsFile f(path); }, kExitData, {path, "tensor 'last'", "truncated?"});

    spit(path, bytes);
    SafetensorsFile f(path);
    expect_error([&] { f.require("middle"); }, kExitData, {path, "no tensor 'middle'"});
    EXPECT_EQ(f.find("middle"), nullptr);

    raw_safetensors(dir / "i64.safetensors", R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})",
                    std::string(16, '\0'));
    SafetensorsFile g(dir / "i64.safetensors");
    std::vector<float> out(2);
    expect_error([&] { g.read_floats(g.require("ids"), out.data()); }, kExitData, {"tensor 'ids'", "dtype I64"});
}

TEST(Safetensors, DeeplyNestedJsonIsRefusedNotACrash) {
    // The 100 MB header bound leaves room for 50 million nested arrays; quoting such a value in a message
    // (nlohmann's dump() recurses once per level) must not overflow the stack, nor may config.json's.
    TempDir dir("st_deep");
    const std::string deep = std::string(200000, '[') + std::string(200000, ']');
    const std::string path = dir / "deep.safetensors";
    raw_safetensors(path, R"({"w":{"dtype":)" + deep + R"(,"shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'));
    expect_error([&] { SafetensorsFile f(path); }, kExitData, {path, "nested deeper than"});

    GPT2Config c = tiny_config();
    write_folder(dir / "m", c, hf_tensors_by_hand(c, random_params(c, 25)));
    std::string config = hf_config_json(c, "float32").dump();
    const size_t at = config.find("\"gelu_new\"");
    ASSERT_NE(at, std::string::npos);
    spit(dir / "m/config.json", config.replace(at, std::strlen("\"gelu_new\""), deep));
    expect_error([&] { probe_model(dir / "m"); }, kExitData, {dir / "m/config.json", "nested deeper than"});
}

TEST(Safetensors, MissingFileIsAnIoError) {
    TempDir dir("st_missing");
    expect_error([&] { SafetensorsFile f(dir / "nope.safetensors"); }, kExitIo, {"nope.safetensors"});
}

// ----------------------------------------------------------------------------------------------------
// llm.c model files: both versions written, bf16 rounded to nearest even

TEST(ModelFile, WritesVersion3And5WithRoundToNearestEven) {
    TempDir dir("mf_write");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 3);
    // Exact ties and near-ties in lnfb, the last tensor: ties go to the even bf16, the rest to the nearest.
    const uint32_t bits[] = {0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001, 0x3F817FFF, 0x7F7FFFFF};
    const uint16_t rounded[] = {0x3F80, 0x3F82, 0xBF80, 0x3F81, 0x3F81, 0x7F80};
    const int64_t lnfb = param_tensors(c)[kLnfb].offset;
    for (int i = 0; i < 6; i++) std::memcpy(&p[size_t(lnfb + i)], &bits[i], 4);

    save_model(dir / "v3.bin", ModelFormat::Llmc, c, p.data());
    save_model(dir / "v5.bin", ModelFormat::LlmcBf16, c, p.data());
    const std::string v3 = slurp(dir / "v3.bin"), v5 = slurp(dir / "v5.bin");
    const int64_t n = num_parameters(c);
    ASSERT_EQ(int64_t(v3.size()), kModelHeaderBytes + 4 * n);
    ASSERT_EQ(int64_t(v5.size()), kModelHeaderBytes + 2 * n);
    int32_t h3[8], h5[8];
    std::memcpy(h3, v3.data(), sizeof(h3));
    std::memcpy(h5, v5.data(), sizeof(h5));
    EXPECT_EQ(h3[1], 3);
    EXPECT_EQ(h5[1], 5);
    EXPECT_EQ(h5[7], 128);
    EXPECT_EQ(std::memcmp(v3.data() + kModelHeaderBytes, p.data(), size_t(4 * n)), 0);
    for (int i = 0; i < 6; i++) {
        uint16_t got;
        std::memcpy(&got, v5.data() + kModelHeaderBytes + 2 * (lnfb + i), 2);
        EXPECT_EQ(got, rounded[i]) << "value " << i;
    }
    ModelInfo info = probe_model(dir / "v5.bin");
    EXPECT_FALSE(info.hf);
    EXPECT_EQ(info.llmc_version, 5);
    EXPECT_EQ(info.dtype, "bf16");
    EXPECT_EQ(info.config, c);
}

// ----------------------------------------------------------------------------------------------------
// Hugging Face folders

TEST(HfModel, ExportLayoutMatchesConv1DConventionElementByElement) {
    TempDir dir("hf_layout");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 11);
    save_model(dir / "m", ModelFormat::Hf, c, p.data());
    SafetensorsFile f(dir / "m/model.safetensors");
    std::vector<NamedTensor> expected = hf_tensors_by_hand(c, p);
    ASSERT_EQ(f.tensors().size(), expected.size());
    for (const NamedTensor& t : expected) {
        SCOPED_TRACE(t.name);
        ASSERT_NE(f.find(t.name), nullptr);
        EXPECT_EQ(f.require(t.name).dtype, "F32");
        EXPECT_EQ(f.require(t.name).shape, t.shape);
        EXPECT_EQ(read_tensor(f, t.name), t.values);
    }
    EXPECT_EQ(f.find("lm_head.weight"), nullptr);
    EXPECT_EQ(f.metadata().at("format"), "pt");

    json config = json::parse(slurp(dir / "m/config.json"));
    EXPECT_EQ(config["architectures"], json::array({"GPT2LMHeadModel"}));
    EXPECT_EQ(config["model_type"], "gpt2");
    EXPECT_EQ(config["vocab_size"], 67);  // unpadded
    EXPECT_EQ(config["n_positions"], 11);
    EXPECT_EQ(config["n_ctx"], 11);
    EXPECT_EQ(config["n_layer"], 2);
    EXPECT_EQ(config["n_head"], 3);
    EXPECT_EQ(config["n_embd"], 24);
    EXPECT_EQ(config["activation_function"], "gelu_new");
    EXPECT_EQ(config["layer_norm_epsilon"], 1e-5);
    EXPECT_EQ(config["tie_word_embeddings"], true);
    EXPECT_EQ(config["torch_dtype"], "float32");
    EXPECT_FALSE(std::filesystem::exists(dir / "m/vocab.json"));  // no tokenizer without a tokenizer dir
    EXPECT_FALSE(std::filesystem::exists(dir / "m/model.safetensors.tmp"));
}

TEST(HfModel, FolderRoundTripIsExactAndPadsTheVocabulary) {
    TempDir dir("hf_rt");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 12);
    save_model(dir / "m", ModelFormat::Hf, c, p.data());
    ModelInfo info = probe_model(dir / "m");
    EXPECT_TRUE(info.hf);
    EXPECT_EQ(info.dtype, "fp32");
    EXPECT_EQ(info.config, c);
    EXPECT_NE(info.describe().find("Hugging Face folder"), std::string::npos);
    std::vector<float> q = load_model_params(dir / "m", info);
    ASSERT_EQ(q.size(), p.size());
    EXPECT_EQ(std::memcmp(q.data(), p.data(), p.size() * 4), 0);
    // Into a buffer that held something else: every element is written, the padded rows with zeros.
    std::vector<float> poisoned(p.size(), NAN);
    read_hf_params(info.folder, poisoned.data());
    EXPECT_EQ(std::memcmp(poisoned.data(), p.data(), p.size() * 4), 0);
}

TEST(HfModel, LlmcV3ThroughHfFolderIsByteIdentical) {
    TempDir dir("hf_v3");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 13);
    write_model_file(dir / "a.bin", c, p.data(), kModelVersionFp32);
    ModelInfo a = probe_model(dir / "a.bin");
    save_model(dir / "hf", ModelFormat::Hf, a.config, load_model_params(dir / "a.bin", a).data());
    ModelInfo h = probe_model(dir / "hf");
    save_model(dir / "b.bin", ModelFormat::Llmc, h.config, load_model_params(dir / "hf", h).data());
    EXPECT_EQ(slurp(dir / "a.bin"), slurp(dir / "b.bin"));
}

TEST(HfModel, LlmcV5ThroughBf16FolderIsByteIdentical) {
    TempDir dir("hf_v5");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 14);
    write_model_file(dir / "a.bin", c, p.data(), kModelVersionBf16);
    ModelInfo a = probe_model(dir / "a.bin");
    save_model(dir / "hf", ModelFormat::HfBf16, a.config, load_model_params(dir / "a.bin", a).data());
    ModelInfo h = probe_model(dir / "hf");
    EXPECT_EQ(h.dtype, "bf16");
    EXPECT_EQ(json::parse(slurp(dir / "hf/config.json"))["torch_dtype"], "bfloat16");
    save_model(dir / "b.bin", ModelFormat::LlmcBf16, h.config, load_model_params(dir / "hf", h).data());
    EXPECT_EQ(slurp(dir / "a.bin"), slurp(dir / "b.bin"));
    EXPECT_NE(slurp(dir / "a.bin").substr(size_t(kModelHeaderBytes)),
              std::string(reinterpret_cast<const char*>(p.data()), p.size() * 2));  // really rounded
}

TEST(HfModel, HfThroughLlmcV3GivesTheSameTensors) {
    TempDir dir("hf_hf");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 15);
    // A folder as transformers might hold it: unprefixed names, a tied lm_head, mask buffers.
    std::vector<NamedTensor> tensors = hf_tensors_by_hand(c, p, "");
    tensors.push_back({"lm_head.weight", tensors[0].shape, tensors[0].values});
    tensors.push_back({"h.1.attn.bias", {1, 1, 11, 11}, std::vector<float>(121, 1.0f)});
    tensors.push_back({"h.0.attn.masked_bias", {}, {-1e4f}});
    write_folder(dir / "src", c, tensors);
    ModelInfo s = probe_model(dir / "src");
    save_model(dir / "mid.bin", ModelFormat::Llmc, s.config, load_model_params(dir / "src", s).data());
    ModelInfo m = probe_model(dir / "mid.bin");
    save_model(dir / "out", ModelFormat::Hf, m.config, load_model_params(dir / "mid.bin", m).data());

    SafetensorsFile a(dir / "src/model.safetensors"), b(dir / "out/model.safetensors");
    for (const NamedTensor& t : hf_tensors_by_hand(c, p, "")) {
        SCOPED_TRACE(t.name);
        const SafetensorsTensor& tb = b.require("transformer." + t.name);
        EXPECT_EQ(tb.shape, a.require(t.name).shape);
        EXPECT_EQ(tb.dtype, a.require(t.name).dtype);
        EXPECT_EQ(read_tensor(b, "transformer." + t.name), read_tensor(a, t.name));
    }
    EXPECT_EQ(b.tensors().size(), hf_tensors_by_hand(c, p).size());
}

TEST(HfModel, ShardedFoldersLoadThroughTheIndex) {
    TempDir dir("hf_shard");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 16);
    std::vector<NamedTensor> all = hf_tensors_by_hand(c, p);
    std::vector<NamedTensor> first(all.begin(), all.begin() + 9), second(all.begin() + 9, all.end());
    const std::string d = dir / "m";
    std::filesystem::create_directories(d);
    spit(d + "/config.json", hf_config_json(c, "float32").dump());
    write_tensors(d + "/model-00001-of-00002.safetensors", first);
    write_tensors(d + "/model-00002-of-00002.safetensors", second, "BF16");
    json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
    for (const NamedTensor& t : first) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
    for (const NamedTensor& t : second) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
    spit(d + "/model.safetensors.index.json", index.dump());

    ModelInfo info = probe_model(d);
    EXPECT_EQ(info.folder.files.size(), 2u);
    EXPECT_EQ(info.dtype, "mixed (bf16, fp32)");
    std::vector<float> q = load_model_params(d, info);
    std::vector<float> expected = p;
    for (int64_t i = 0; i < int64_t(p.size()); i++) {
        bool in_second = false;  // tensors of the second shard went through bf16
        for (const HfTensorMap& m : hf_tensor_map(c)) {
            if (i >= m.offset && i < m.offset + m.numel) {
                for (const NamedTensor& t : second) in_second |= t.name == "transformer." + m.name;
            }
        }
        if (in_second) expected[size_t(i)] = bf16_to_float(float_to_bf16(p[size_t(i)]));
    }
    EXPECT_EQ(q, expected);

    std::string text = index.dump();
    ASSERT_NE(text.find("\"total_size\":0"), std::string::npos);
    spit(d + "/model.safetensors.index.json", text.replace(text.find("\"total_size\":0"), 14, "\"total_size\":1e999"));
    expect_error([&] { probe_model(d); }, kExitData,
                 {"model.safetensors.index.json", "key 'metadata', key 'total_size'", "number overflow"});
    spit(d + "/model.safetensors.index.json", index.dump());

    // Saving into a sharded folder would leave its shards beside the new file: refused.
    expect_error([&] { save_model(d, ModelFormat::Hf, c, p.data()); }, kExitIo, {"sharded", d});

    index["weight_map"]["transformer.wte.weight"] = "model-00002-of-00002.safetensors";
    spit(d + "/model.safetensors.index.json", index.dump());
    expect_error([&] { probe_model(d); }, kExitData, {"transformer.wte.weight", "does not hold it"});

    index["weight_map"]["transformer.wte.weight"] = "model-00003-of-00003.safetensors";
    spit(d + "/model.safetensors.index.json", index.dump());
    expect_error([&] { probe_model(d); }, kExitIo, {"model-00003-of-00003.safetensors", "does not exist"});

    index["weight_map"]["transformer.wte.weight"] = "../elsewhere.safetensors";
    spit(d + "/model.safetensors.index.json", index.dump());
    expect_error([&] { probe_model(d); }, kExitData, {"../elsewhere.safetensors", "not a file in the folder"});

    spit(d + "/model.safetensors.index.json", R"({"metadata": {}})");
    expect_error([&] { probe_model(d); }, kExitData, {"no weight_map"});

    // A tensor in two shards is ambiguous.
    write_tensors(d + "/model-00002-of-00002.safetensors", std::vector<NamedTensor>{all.begin() + 8, all.end()});
    index["weight_map"]["transformer.wte.weight"] = "model-00001-of-00002.safetensors";
    spit(d + "/model.safetensors.index.json", index.dump());
    expect_error([&] { probe_model(d); }, kExitData, {all[8].name, "in both"});
}

TEST(HfModel, Bf16FolderLoadsAsRoundedValues) {
    TempDir dir("hf_bf16");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 17);
    save_model(dir / "m", ModelFormat::HfBf16, c, p.data());
    std::vector<float> q = load(dir / "m");
    for (size_t i = 0; i < p.size(); i++) ASSERT_EQ(q[i], bf16_to_float(float_to_bf16(p[i]))) << i;
}

TEST(HfModel, ConfigKeysOurModelCannotComputeAreRefused) {
    TempDir dir("hf_config");
    GPT2Config c = tiny_config();
    std::vector<NamedTensor> tensors = hf_tensors_by_hand(c, random_params(c, 18));
    struct Case {
        json edits;
        std::vector<std::string> message;
    };
    const std::vector<Case> refused = {
        {{{"model_type", "bert"}}, {"model_type is \"bert\""}},
        {{{"model_type", "<erase>"}}, {"model_type is (absent)"}},
        {{{"activation_function", "relu"}}, {"activation_function is \"relu\"", "tanh GELU"}},
        {{{"activation_function", "gelu"}}, {"activation_function is \"gelu\""}},
        {{{"layer_norm_epsilon", 1e-6}}, {"layer_norm_epsilon is 1e-06"}},
        {{{"scale_attn_weights", false}}, {"scale_attn_weights is false"}},
        {{{"scale_attn_by_inverse_layer_idx", true}}, {"scale_attn_by_inverse_layer_idx is true"}},
        {{{"add_cross_attention", true}}, {"add_cross_attention is true"}},
        {{{"tie_word_embeddings", false}}, {"tie_word_embeddings is false"}},
        {{{"n_inner", 100}}, {"n_inner is 100"}},
        {{{"n_layer", "<erase>"}}, {"'n_layer' is missing"}},
        {{{"n_embd", 24.5}}, {"'n_embd' is 24.5"}},
        {{{"n_head", 5}}, {"not a multiple of num_heads 5"}},
    };
    for (const Case& k : refused) {
        SCOPED_TRACE(k.edits.dump());
        std::filesystem::remove_all(dir / "m");
        write_folder(dir / "m", c, tensors, k.edits);
        std::vector<std::string> parts = k.message;
        parts.push_back(dir / "m/config.json");
        expect_error([&] { probe_model(dir / "m"); }, kExitData, parts);
    }
    const std::vector<json> accepted = {
        {{"activation_function", "gelu_pytorch_tanh"}},
        {{"n_inner", 96}},
        {{"layer_norm_epsilon", "<erase>"}, {"activation_function", "<erase>"}, {"tie_word_embeddings", "<erase>"},
         {"n_inner", "<erase>"}, {"scale_attn_weights", "<erase>"}},
    };
    for (const json& edits : accepted) {
        SCOPED_TRACE(edits.dump());
        std::filesystem::remove_all(dir / "m");
        write_folder(dir / "m", c, tensors, edits);
        EXPECT_EQ(probe_model(dir / "m").config, c);
    }
    spit(dir / "m/config.json", "{\"model_type\": ");
    expect_error([&] { probe_model(dir / "m"); }, kExitData, {"config.json", "not valid JSON"});
    // What nlohmann would throw past a parse error, or read past: a number beyond double's range, a NUL.
    std::string text = hf_config_json(c, "float32").dump();
    const size_t at = text.find("\"initializer_range\":0.02");
    ASSERT_NE(at, std::string::npos);
    spit(dir / "m/config.json", std::string(text).replace(at, 25, "\"initializer_range\":1e999"));
    expect_error([&] { probe_model(dir / "m"); }, kExitData,
                 {dir / "m/config.json", "key 'initializer_range'", "number overflow parsing '1e999'"});
    spit(dir / "m/config.json", text + std::string(1, '\0') + "{\"n_layer\": 7}");
    expect_error([&] { probe_model(dir / "m"); }, kExitData,
                 {dir / "m/config.json", format("NUL byte at offset %zu", text.size())});
    spit(dir / "m/config.json", "{\"n_layer\": 2, " + text.substr(1));
    expect_error([&] { probe_model(dir / "m"); }, kExitData, {dir / "m/config.json", "key 'n_layer' appears twice"});
}

TEST(HfModel, TensorsThatDoNotFitAreRefusedByName) {
    TempDir dir("hf_tensors");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 19);
    const std::vector<NamedTensor> good = hf_tensors_by_hand(c, p);
    auto attempt = [&](std::vector<NamedTensor> tensors, int code, std::vector<std::string> parts) {
        std::filesystem::remove_all(dir / "m");
        write_folder(dir / "m", c, tensors);
        expect_error([&] { load(dir / "m"); }, code, parts);
    };
    {
        SCOPED_TRACE("missing");
        std::vector<NamedTensor> t = good;
        auto gone = [](const NamedTensor& x) { return x.name == "transformer.h.1.mlp.c_fc.bias"; };
        t.erase(std::remove_if(t.begin(), t.end(), gone), t.end());
        attempt(t, kExitData, {"'transformer.h.1.mlp.c_fc.bias'", "'h.1.mlp.c_fc.bias'", "is missing"});
    }
    {
        SCOPED_TRACE("our layout instead of Conv1D");
        std::vector<NamedTensor> t = good;
        for (NamedTensor& x : t) {
            if (x.name == "transformer.h.0.attn.c_attn.weight") x.shape = {72, 24};
        }
        attempt(t, kExitData, {"transformer.h.0.attn.c_attn.weight", "[72, 24]", "[24, 72]", "Conv1D"});
    }
    {
        SCOPED_TRACE("wrong vocabulary");
        std::vector<NamedTensor> t = good;
        t[0].shape = {66, 24};
        t[0].values.resize(66 * 24);
        attempt(t, kExitData, {"transformer.wte.weight", "[66, 24]", "[67, 24]"});
    }
    {
        SCOPED_TRACE("unknown tensor");
        std::vector<NamedTensor> t = good;
        t.push_back({"transformer.h.0.attn.c_attn.lora_A", {2}, {1, 2}});
        attempt(t, kExitData, {"transformer.h.0.attn.c_attn.lora_A", "refusing to drop it"});
    }
    {
        SCOPED_TRACE("a layer beyond n_layer");
        std::vector<NamedTensor> t = good;
        t.push_back({"transformer.h.2.attn.bias", {1}, {1}});
        attempt(t, kExitData, {"transformer.h.2.attn.bias", "not part of"});
    }
    {
        SCOPED_TRACE("untied lm_head");
        std::vector<NamedTensor> t = good;
        NamedTensor head = t[0];
        head.name = "lm_head.weight";
        head.values[size_t(5 * 24 + 7)] += 1.0f;
        t.push_back(head);
        attempt(t, kExitData, {"lm_head.weight", "row 5, column 7", "not tied"});
    }
    {
        SCOPED_TRACE("the embedding stored under the head's name only");
        std::vector<NamedTensor> t = good;
        t[0].name = "lm_head.weight";
        std::filesystem::remove_all(dir / "m");
        write_folder(dir / "m", c, t);
        EXPECT_EQ(load(dir / "m"), p);
        t[0].shape = {67, 23};
        t[0].values.resize(67 * 23);
        attempt(t, kExitData, {"'lm_head.weight' has shape [67, 23]", "[67, 24]"});
    }
    {
        SCOPED_TRACE("lm_head of another shape");
        std::vector<NamedTensor> t = good;
        t.push_back({"lm_head.weight", {3}, {1, 2, 3}});
        attempt(t, kExitData, {"lm_head.weight", "[3]", "ties its output layer"});
    }
    {
        SCOPED_TRACE("both prefixed and unprefixed");
        std::vector<NamedTensor> t = good;
        NamedTensor dup = t[1];
        dup.name = "wpe.weight";
        t.push_back(dup);
        attempt(t, kExitData, {"'transformer.wpe.weight' and 'wpe.weight'", "ambiguous"});
    }
    {
        SCOPED_TRACE("integer weights");
        std::filesystem::remove_all(dir / "m");
        write_folder(dir / "m", c, good);
        // Rewrite the file by hand with ln_f.bias as I32 (same byte size as F32).
        SafetensorsFile f(dir / "m/model.safetensors");
        std::string bytes = slurp(dir / "m/model.safetensors");
        std::string header = bytes.substr(8, size_t(f.data_offset() - 8));
        json j = json::parse(header);
        j["transformer.ln_f.bias"]["dtype"] = "I32";
        raw_safetensors(dir / "m/model.safetensors", j.dump(), bytes.substr(size_t(f.data_offset())));
        expect_error([&] { load(dir / "m"); }, kExitData, {"transformer.ln_f.bias", "dtype I32", "F32, F16 or BF16"});
    }
}

TEST(HfModel, FolderChangedBetweenProbeAndLoadIsRefused) {
    TempDir dir("hf_changed");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 20);
    save_model(dir / "m", ModelFormat::Hf, c, p.data());
    ModelInfo info = probe_model(dir / "m");
    GPT2Config other = make_config(2, 24, 4, 67, 11);
    save_model(dir / "m", ModelFormat::Hf, other, random_params(other, 21).data());
    expect_error([&] { load_model_params(dir / "m", info); }, kExitData, {"changed since"});
}

// A model that holds a NaN or an infinity trains to nan from the first step: every format is refused at
// load (load_model_params, which both trainers and the converter use), naming the file, tensor and count.
TEST(HfModel, NonFiniteParametersAreRefusedNamingFileTensorAndCount) {
    TempDir dir("nonfinite");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 29);
    const auto t = param_tensors(c);
    // Extremes that are finite must pass: the largest bfloat16, the smallest subnormal, negative zero.
    p[size_t(t[kLnfb].offset)] = 0x1.fep127f;
    p[size_t(t[kLnfb].offset + 1)] = -std::numeric_limits<float>::denorm_min();
    p[size_t(t[kLnfb].offset + 2)] = -0.0f;
    save_model(dir / "ok.bin", ModelFormat::Llmc, c, p.data());
    EXPECT_EQ(load(dir / "ok.bin"), p);

    const int64_t first = t[kFcw].offset + 4 * 24 * 24 + 5;  // in the second layer's fcw
    p[size_t(first)] = NAN;
    p[size_t(first + 7)] = -INFINITY;
    p[size_t(t[kLnfw].offset)] = INFINITY;
    for (ModelFormat f : {ModelFormat::Llmc, ModelFormat::LlmcBf16}) {
        SCOPED_TRACE(model_format_name(f));
        save_model(dir / "m.bin", f, c, p.data());
        const int64_t bytes = f == ModelFormat::Llmc ? 4 : 2;
        expect_error([&] { load(dir / "m.bin"); }, kExitData,
                     {"model file '" + dir / "m.bin'", "3 parameters are not finite",
                      format("2 in tensor fcw, the first at offset %lld", (long long)(1024 + first * bytes))});
    }
    // Named as the folder names them.
    save_model(dir / "hf", ModelFormat::HfBf16, c, p.data());
    expect_error([&] { load(dir / "hf"); }, kExitData,
                 {"Hugging Face model '" + dir / "hf'", "3 parameters are not finite",
                  "2 in tensor 'transformer.h.1.mlp.c_fc.weight' of '" + dir / "hf/model.safetensors'"});
}

TEST(HfModel, LmHeadChangedBetweenProbeAndReadIsRefused) {
    // read_hf_params() reopens the files probe_hf_folder() checked; a head that grew meanwhile would be
    // compared with wte past wte's end.
    TempDir dir("hf_head_changed");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 28);
    std::vector<NamedTensor> tensors = hf_tensors_by_hand(c, p);
    tensors.push_back({"lm_head.weight", tensors[0].shape, tensors[0].values});
    write_folder(dir / "m", c, tensors);
    const HfFolder h = probe_model(dir / "m").folder;
    ASSERT_TRUE(h.has_lm_head);
    NamedTensor& head = tensors.back();
    head.shape[0] *= 40;
    head.values.assign(size_t(head.shape[0] * head.shape[1]), 0.0f);
    std::copy(tensors[0].values.begin(), tensors[0].values.end(), head.values.begin());
    write_tensors(dir / "m/model.safetensors", tensors);
    std::vector<float> params(size_t(num_parameters(c)));
    expect_error([&] { read_hf_params(h, params.data()); }, kExitData, {"lm_head.weight", "changed since"});
}

TEST(HfModel, ExportThatFailsKeepsThePreviousFolderAndLeavesNoTemporaryFile) {
    TempDir dir("hf_fail");
    GPT2Config c = tiny_config();
    std::vector<float> old_p = random_params(c, 26), new_p = random_params(c, 27);
    save_model(dir / "m", ModelFormat::Hf, c, old_p.data());
    const std::string before = slurp(dir / "m/model.safetensors");
    // A disk that fills up half way through the new model.safetensors, as a file size limit does (set in
    // this process, not a forked one: OpenMP's threads do not survive a fork).
    struct rlimit saved;
    ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
    struct rlimit lim = saved;
    lim.rlim_cur = before.size() / 2;
    auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // else the kernel kills the process instead of failing the write
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
    expect_error([&] { save_model(dir / "m", ModelFormat::Hf, c, new_p.data()); }, kExitIo,
                 {"model.safetensors.tmp", "File too large"});
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &saved), 0);
    std::signal(SIGXFSZ, old_handler);
    EXPECT_EQ(slurp(dir / "m/model.safetensors"), before);
    EXPECT_FALSE(std::filesystem::exists(dir / "m/model.safetensors.tmp"));
    EXPECT_EQ(load(dir / "m"), old_p);
}

TEST(HfModel, PathErrorsSayWhatThePathIs) {
    TempDir dir("hf_paths");
    GPT2Config c = tiny_config();
    std::vector<float> p = random_params(c, 22);
    expect_error([&] { probe_model(dir / "nothing"); }, kExitIo, {"nothing", "does not exist"});
    // What is there but cannot be read gets the system's reason, not "does not exist".
    ASSERT_EQ(::symlink("loop", (dir / "loop").c_str()), 0);
    expect_error([&] { probe_model(dir / "loop"); }, kExitIo,
                 {dir / "loop", "Too many levels of symbolic links", "expected an llm.c model file"});
    ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
    expect_error([&] { probe_model(dir / "fifo"); }, kExitIo, {dir / "fifo", "is a FIFO, not a regular file"});
    EXPECT_TRUE(model_path_exists(dir / "loop"));  // so that a trainer asks probe_model, which says why
    EXPECT_TRUE(model_path_exists(dir / "fifo"));
    EXPECT_FALSE(model_path_exists(dir / "nothing"));
    std::filesystem::create_directories(dir / "looped");
    ASSERT_EQ(::symlink("config.json", (dir / "looped/config.json").c_str()), 0);
    expect_error([&] { probe_model(dir / "looped"); }, kExitIo,
                 {dir / "looped/config.json", "Too many levels of symbolic links"});
    std::filesystem::create_directories(dir / "empty");
    expect_error([&] { probe_model(dir / "empty"); }, kExitIo, {"empty", "is a directory without config.json"});
    expect_error([&] { save_model(dir / "empty", ModelFormat::Llmc, c, p.data()); }, kExitIo,
                 {"empty", "is a directory", "model.bin"});
    write_model_file(dir / "a.bin", c, p.data(), kModelVersionFp32);
    expect_error([&] { save_model(dir / "a.bin", ModelFormat::Hf, c, p.data()); }, kExitIo,
                 {"a.bin", "is not a directory"});
    std::filesystem::create_directories(dir / "pickle");
    spit(dir / "pickle/config.json", hf_config_json(c, "float32").dump());
    spit(dir / "pickle/pytorch_model.bin", "PK");
    expect_error([&] { probe_model(dir / "pickle"); }, kExitData, {"pytorch_model.bin", "pickle", "safetensors"});
    std::filesystem::remove(dir / "pickle/pytorch_model.bin");
    expect_error([&] { probe_model(dir / "pickle"); }, kExitIo, {"neither model.safetensors"});
    EXPECT_TRUE(model_path_exists(dir / "a.bin"));
    EXPECT_TRUE(model_path_exists(dir / "empty"));
    EXPECT_FALSE(model_path_exists("d12"));
}

TEST(HfModel, FormatNames) {
    EXPECT_EQ(parse_model_format("llmc"), ModelFormat::Llmc);
    EXPECT_EQ(parse_model_format("llmc-bf16"), ModelFormat::LlmcBf16);
    EXPECT_EQ(parse_model_format("hf"), ModelFormat::Hf);
    EXPECT_EQ(parse_model_format("hf-bf16"), ModelFormat::HfBf16);
    expect_error([] { parse_model_format("gguf"); }, kExitUsage, {"'gguf'", "llmc, llmc-bf16, hf or hf-bf16"});
}

TEST(HfModel, TokenizerFilesAreGpt2sByteForByte) {
    const std::string tok = ".deps/gpt2";
    if (!std::filesystem::exists(tok + "/encoder.json") || !std::filesystem::exists(tok + "/vocab.bpe")) {
        GTEST_SKIP() << "skipped: GPT-2's tokenizer files are not in " << tok << " (scripts/setup.sh fetches them)";
    }
    TempDir dir("hf_tok");
    GPT2Config c = make_config(1, 8, 2, kGPT2VocabSize, 8);
    std::vector<float> p = random_params(c, 23);
    SaveOptions o;
    o.tokenizer_dir = tok;
    save_model(dir / "m", ModelFormat::Hf, c, p.data(), o);
    EXPECT_EQ(slurp(dir / "m/vocab.json"), slurp(tok + "/encoder.json"));
    EXPECT_EQ(slurp(dir / "m/merges.txt"), slurp(tok + "/vocab.bpe"));
    json tc = json::parse(slurp(dir / "m/tokenizer_config.json"));
    EXPECT_EQ(tc["tokenizer_class"], "GPT2Tokenizer");
    EXPECT_EQ(tc["eos_token"], "<|endoftext|>");
    EXPECT_EQ(tc["model_max_length"], 8);
    json config = json::parse(slurp(dir / "m/config.json"));
    EXPECT_EQ(config["eos_token_id"], 50256);
    EXPECT_EQ(config["bos_token_id"], 50256);

    GPT2Config small = tiny_config();
    std::vector<float> q = random_params(small, 24);
    expect_error([&] { save_model(dir / "s", ModelFormat::Hf, small, q.data(), o); }, kExitUsage,
                 {"50257 tokens", "vocabulary is 67"});
    o.tokenizer_dir = dir.path();
    expect_error([&] { save_model(dir / "s", ModelFormat::Hf, small, q.data(), o); }, kExitIo, {"encoder.json"});
}

// What the trainers' exports copy (tokenizer_for_export): --vocab-dir when its tokenizer fits the model's
// vocabulary, else nothing, with a note; the export of a model on its own vocabulary then goes through.
TEST(HfModel, TrainersCopyATokenizerOnlyWhereItFitsTheVocabulary) {
    TempDir dir("hf_tok_export");
    std::string note = "stale";
    EXPECT_EQ(tokenizer_for_export(dir.path(), 3, &note), "");  // no tokenizer files: nothing, quietly
    EXPECT_EQ(note, "");
    spit(dir / "encoder.json", R"({"a": 0, "b": 1, "ab": 2})");
    EXPECT_EQ(tokenizer_for_export(dir.path(), 3, &note), "");
    EXPECT_NE(note.find("not vocab.bpe"), std::string::npos) << note;
    spit(dir / "vocab.bpe", "#version: 0.2\na b\n");
    EXPECT_EQ(tokenizer_for_export(dir.path(), 3, &note), dir.path());
    EXPECT_EQ(note, "");
    EXPECT_EQ(tokenizer_for_export(dir.path(), 67, &note), "");
    EXPECT_NE(note.find("has 3 tokens, the model's vocabulary 67"), std::string::npos) << note;
    // The model of 67 tokens exports without tokenizer files where the 3-token tokenizer would be refused.
    GPT2Config small = tiny_config();
    std::vector<float> q = random_params(small, 26);
    SaveOptions o;
    o.tokenizer_dir = tokenizer_for_export(dir.path(), small.vocab_size, &note);
    // Into a folder that holds an earlier export's tokenizer files: those go, with the new weights.
    std::filesystem::create_directories(dir / "m");
    for (const char* name : {"vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json"}) {
        spit(dir / (std::string("m/") + name), "{}");
    }
    save_model(dir / "m", ModelFormat::Hf, small, q.data(), o);
    EXPECT_TRUE(std::filesystem::exists(dir / "m/model.safetensors"));
    for (const char* name : {"vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json"}) {
        EXPECT_FALSE(std::filesystem::exists(dir / (std::string("m/") + name))) << name << " of an earlier export was left";
    }
    o.tokenizer_dir = dir.path();
    expect_error([&] { save_model(dir / "m2", ModelFormat::Hf, small, q.data(), o); }, kExitUsage, {"3 tokens"});
}

}  // namespace
