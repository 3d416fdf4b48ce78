/*
The shape of a GPT-2 model and everything that follows from it alone: GPT2Config (maxT, V, Vp, L, NH,
C) from a descriptor or numbers, validate_config(), the 16 parameter tensors in llm.c's order (shapes,
offsets into one flat array, decayed or not), the deterministic initialisation and llm.c's FLOPs per
token. Descriptors: d12, d24, d36, d48 are GPT-2 small to XL; d2 and d6 follow llm.c's d6 rule (head
size 64, C = 64 * L, NH = L). All take V = 50257 (Vp = 50304) and maxT = 1024.
*/
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

#include "llmc/rand.h"
#include "llmc/utils.h"

namespace llmc {

constexpr int kGPT2VocabSize = 50257;
constexpr int kGPT2MaxSeqLen = 1024;
// The vocabulary is padded so the classifier matmul gets friendly sizes; padded rows of wte stay zero.
constexpr int kVocabPadMultiple = 128;

struct GPT2Config {
    int max_seq_len = 0;        // maxT: rows of the position embedding
    int vocab_size = 0;         // V: real tokens
    int padded_vocab_size = 0;  // Vp >= V: rows of the token embedding and columns of the logits
    int num_layers = 0;         // L
    int num_heads = 0;          // NH
    int channels = 0;           // C

    int head_size() const { return channels / num_heads; }
    auto fields() const { return std::tie(max_seq_len, vocab_size, padded_vocab_size, num_layers, num_heads, channels); }
    bool operator==(const GPT2Config& o) const { return fields() == o.fields(); }
    bool operator!=(const GPT2Config& o) const { return fields() != o.fields(); }
};

inline std::string describe(const GPT2Config& c) {
    return format("maxT=%d V=%d Vp=%d L=%d NH=%d C=%d", c.max_seq_len, c.vocab_size, c.padded_vocab_size,
                  c.num_layers, c.num_heads, c.channels);
}

inline int padded_vocab(int vocab_size) {
    return (vocab_size + kVocabPadMultiple - 1) / kVocabPadMultiple * kVocabPadMultiple;
}

// Empty when the shape is usable, else what is wrong. The upper bounds only reject garbage before it
// becomes a huge allocation.
inline std::string config_problem(const GPT2Config& c) {
    auto in_range = [](int v, int hi) { return v >= 1 && v <= hi; };
    if (!in_range(c.max_seq_len, 1 << 20)) return format("max_seq_len %d is not in [1, 1048576]", c.max_seq_len);
    if (!in_range(c.vocab_size, 1 << 24)) return format("vocab_size %d is not in [1, 16777216]", c.vocab_size);
    if (c.padded_vocab_size < c.vocab_size || c.padded_vocab_size > (1 << 24)) {
        return format("padded_vocab_size %d is not in [vocab_size=%d, 16777216]", c.padded_vocab_size, c.vocab_size);
    }
    if (!in_range(c.num_layers, 4096)) return format("num_layers %d is not in [1, 4096]", c.num_layers);
    if (!in_range(c.channels, 1 << 16)) return format("channels %d is not in [1, 65536]", c.channels);
    if (!in_range(c.num_heads, c.channels)) return format("num_heads %d is not in [1, channels=%d]", c.num_heads, c.channels);
    if (c.channels % c.num_heads != 0) {
        return format("channels %d is not a multiple of num_heads %d", c.channels, c.num_heads);
    }
    return "";
}

// Raises exit_code with "<context>: <problem>" when the shape is unusable.
inline void validate_config(const GPT2Config& c, int exit_code, const std::string& context) {
    std::string problem = config_problem(c);
    if (!problem.empty()) fail(exit_code, "%s: %s (%s)", context.c_str(), problem.c_str(), describe(c).c_str());
}

// A model of explicit size; Vp is V rounded up to a multiple of 128.
inline GPT2Config make_config(int num_layers, int channels, int num_heads, int vocab_size = kGPT2VocabSize,
                              int max_seq_len = kGPT2MaxSeqLen) {
    const GPT2Config c{max_seq_len, vocab_size, padded_vocab(vocab_size), num_layers, num_heads, channels};
    validate_config(c, kExitUsage, "model shape");
    return c;
}

inline GPT2Config config_from_descriptor(const std::string& descriptor) {
    struct Known {
        const char* name;
        int layers, channels, heads;
    };
    static const Known known[] = {
        {"d2", 2, 128, 2},     {"d6", 6, 384, 6},      {"d12", 12, 768, 12},
        {"d24", 24, 1024, 16}, {"d36", 36, 1280, 20},  {"d48", 48, 1600, 25},
    };
    for (const Known& k : known) {
        if (descriptor == k.name) return make_config(k.layers, k.channels, k.heads);
    }
    fail(kExitUsage, "unknown model descriptor '%s' (expected d2, d6, d12, d24, d36 or d48)", descriptor.c_str());
}

// The parameter tensors, in the order llm.c stores them in memory and in model files.
enum ParamTensor : int {
    kWte, kWpe, kLn1w, kLn1b, kQkvw, kQkvb, kAttprojw, kAttprojb,
    kLn2w, kLn2b, kFcw, kFcb, kFcprojw, kFcprojb, kLnfw, kLnfb,
    kNumParamTensors
};

struct ParamTensorInfo {
    const char* name = "";
    int ndim = 0;
    int64_t shape[3] = {0, 0, 0};  // per-layer tensors lead with L
    int64_t numel = 0;
    int64_t offset = 0;  // elements from the start of the flat parameter array
    bool decayed = false;  // weight matrices (2-D per layer) get AdamW weight decay; biases and LayerNorms do not
};

inline std::array<ParamTensorInfo, kNumParamTensors> param_tensors(const GPT2Config& c) {
    const int64_t Vp = c.padded_vocab_size, maxT = c.max_seq_len, L = c.num_layers, C = c.channels;
    std::array<ParamTensorInfo, kNumParamTensors> t;
    int64_t offset = 0;
    auto set = [&](int i, const char* name, bool decayed, std::initializer_list<int64_t> shape) {
        t[i].name = name;
        t[i].decayed = decayed;
        t[i].ndim = 0;
        t[i].numel = 1;
        for (int64_t d : shape) {
            t[i].shape[t[i].ndim++] = d;
            t[i].numel *= d;
        }
        t[i].offset = offset;  // the calls below go in tensor order
        offset += t[i].numel;
    };
    set(kWte, "wte", true, {Vp, C});
    set(kWpe, "wpe", true, {maxT, C});
    set(kLn1w, "ln1w", false, {L, C});
    set(kLn1b, "ln1b", false, {L, C});
    set(kQkvw, "qkvw", true, {L, 3 * C, C});
    set(kQkvb, "qkvb", false, {L, 3 * C});
    set(kAttprojw, "attprojw", true, {L, C, C});
    set(kAttprojb, "attprojb", false, {L, C});
    set(kLn2w, "ln2w", false, {L, C});
    set(kLn2b, "ln2b", false, {L, C});
    set(kFcw, "fcw", true, {L, 4 * C, C});
    set(kFcb, "fcb", false, {L, 4 * C});
    set(kFcprojw, "fcprojw", true, {L, C, 4 * C});
    set(kFcprojb, "fcprojb", false, {L, C});
    set(kLnfw, "lnfw", false, {C});
    set(kLnfb, "lnfb", false, {C});
    return t;
}

inline int64_t num_parameters(const GPT2Config& c) {
    auto t = param_tensors(c);
    return t[kNumParamTensors - 1].offset + t[kNumParamTensors - 1].numel;
}

// llm.c's MFU convention: 6 FLOPs per parameter per token plus 6*L*C*T for attention.
inline double flops_per_token(const GPT2Config& c, int seq_len) {
    return 6.0 * double(num_parameters(c)) + 6.0 * c.num_layers * double(c.channels) * seq_len;
}

// GPT-2 / nanoGPT initialisation into `params`: weights N(0, 0.02), attprojw and fcprojw N(0,
// 0.02/sqrt(2L)), LayerNorm weights 1, biases and wte's padded rows 0. Element j of tensor i is
// counter_normal(seed, i, j), whatever the thread count.
inline void init_parameters(const GPT2Config& c, uint64_t seed, float* params) {
    auto tensors = param_tensors(c);
    const double residual_std = 0.02 / std::sqrt(2.0 * c.num_layers);
    for (int i = 0; i < kNumParamTensors; i++) {
        const ParamTensorInfo& t = tensors[i];
        float* p = params + t.offset;
        int64_t n = t.numel;
        if (!t.decayed) {
            std::fill(p, p + n, (i == kLn1w || i == kLn2w || i == kLnfw) ? 1.0f : 0.0f);
            continue;
        }
        double stddev = (i == kAttprojw || i == kFcprojw) ? residual_std : 0.02;
        int64_t random = (i == kWte) ? int64_t(c.vocab_size) * c.channels : n;
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            p[j] = j < random ? float(stddev * counter_normal(seed, uint64_t(i), uint64_t(j))) : 0.0f;
        }
    }
}

}  // namespace llmc
