/*
Learning-rate schedules (linear warmup, then cosine, linear, constant or wsd decay to lr *
final_fraction) and the step log's throughput arithmetic (micro_steps_per_step, peak_bf16_flops, mfu:
negative for "unknown").
*/
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "llmc/utils.h"

namespace llmc {

struct LRSchedule {
    enum class Kind { Cosine, Linear, Constant, WSD };
    Kind kind = Kind::Cosine;
    double lr = 6e-4;
    int warmup = 0;
    int total = 1;
    double final_fraction = 0.0;
    double decay_fraction = 0.2;  // wsd only

    static Kind parse_kind(const std::string& name) {
        if (name == "cosine") return Kind::Cosine;
        if (name == "linear") return Kind::Linear;
        if (name == "constant") return Kind::Constant;
        if (name == "wsd") return Kind::WSD;
        fail(kExitUsage, "unknown learning rate schedule '%s' (cosine, linear, constant or wsd)", name.c_str());
    }

    // step counts from 0; decay progress is (step - start) / (total - start), as in llm.c. From step
    // `total` on every schedule is at its floor exactly.
    double at(int step) const {
        const double lo = kind == Kind::Constant ? lr : lr * final_fraction;
        if (step >= total) return lo;
        if (step < warmup) return lr * double(step + 1) / double(warmup);
        if (kind == Kind::Constant) return lr;
        int start = warmup;
        if (kind == Kind::WSD) {
            start = std::max(warmup, total - int(std::lround(decay_fraction * total)));
            if (step < start) return lr;
        }
        const double progress = double(step - start) / double(total - start);  // start <= step < total
        if (kind == Kind::Cosine) return lo + 0.5 * (lr - lo) * (1.0 + std::cos(M_PI * progress));
        return lr + (lo - lr) * progress;  // linear, and the decay phase of wsd
    }
};

// The micro-steps of B x T tokens on each of `ranks` ranks that make one step of tokens_per_step tokens;
// a total that is not a whole number of them (or overflows) is a usage error naming the terms.
inline int micro_steps_per_step(int64_t tokens_per_step, int B, int T, int ranks) {
    const int64_t micro = int64_t(B) * T * ranks;
    const std::string terms = ranks == 1 ? format("B*T = %d*%d", B, T) : format("B*T*ranks = %d*%d*%d", B, T, ranks);
    if (tokens_per_step < 1 || tokens_per_step % micro != 0) {
        fail(kExitUsage, "-d/--total-batch %lld is not a multiple of %s = %lld tokens", (long long)tokens_per_step,
             terms.c_str(), (long long)micro);
    }
    if (tokens_per_step / micro > INT32_MAX) {
        fail(kExitUsage, "-d/--total-batch %lld needs %lld micro-steps of %s = %lld tokens, more than the %d a step can "
             "take", (long long)tokens_per_step, (long long)(tokens_per_step / micro), terms.c_str(), (long long)micro,
             INT32_MAX);
    }
    return int(tokens_per_step / micro);
}

// Dense bf16 tensor-core peak (FLOP/s) by device name; 0 when unknown.
inline double peak_bf16_flops(const std::string& device_name) {
    struct Entry {
        const char* name_part;
        double tflops;
    };
    // Order matters: more specific names first.
    static const Entry table[] = {
        {"H100 PCIe", 756}, {"H100 NVL", 835}, {"H100", 989}, {"H200", 989}, {"GH200", 989},
        {"A100", 312},      {"A800", 312},     {"A10G", 70},  {"A10", 125},  {"L40S", 362},
        {"L40", 181},       {"L4", 121},       {"RTX 4090", 165}, {"RTX 3090", 71}, {"B200", 2250},
    };
    for (const Entry& e : table) {
        if (device_name.find(e.name_part) != std::string::npos) return e.tflops * 1e12;
    }
    return 0.0;
}

// Model FLOPs utilisation in [0, 1+); negative when the GPU's peak is unknown.
inline double mfu(double flops_per_token, double tokens_per_second, double peak_flops) {
    if (peak_flops <= 0 || tokens_per_second < 0) return -1.0;
    return flops_per_token * tokens_per_second / peak_flops;
}

}  // namespace llmc
