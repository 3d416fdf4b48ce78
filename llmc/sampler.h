/*
Picking the next token from a row of logits, for the trainers' text samples (train_gpt2cu and the CPU
trainer train_gpt2 share it, so a model samples the same way on either).

Provides:
  sample_token(logits, temperature, top_k, rng): temperature 0 is greedy (the largest logit, the lower
      id on ties); otherwise a draw from softmax(logits / temperature) restricted to the top_k largest
      logits (all of them when top_k is 0 or at least the row's length), computed in double from the
      largest, with one SplitMix64 number per draw, so a seed gives the same tokens on every machine.

  parse_token_ids(text, vocab_size, flag): "464,3290" -> ids, each checked against the vocabulary (what
      --prompt-ids takes in both trainers).

Does not provide: nucleus (top-p) sampling, repetition penalties, batched sampling.
*/
#pragma once

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "llmc/rand.h"
#include "llmc/utils.h"

namespace llmc {

inline uint32_t sample_token(const std::vector<float>& logits, float temperature, int top_k, SplitMix64& rng) {
    const int V = int(logits.size());
    std::vector<int> ids(static_cast<size_t>(V));
    for (int i = 0; i < V; i++) ids[size_t(i)] = i;
    auto better = [&](int a, int b) {
        return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
    };
    if (temperature == 0.0f) return uint32_t(*std::min_element(ids.begin(), ids.end(), better));
    const int k = (top_k > 0 && top_k < V) ? top_k : V;
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), better);
    const double top = logits[size_t(ids[0])];
    std::vector<double> w(static_cast<size_t>(k));
    double sum = 0.0;
    for (int i = 0; i < k; i++) {
        w[size_t(i)] = std::exp((double(logits[size_t(ids[size_t(i)])]) - top) / double(temperature));
        sum += w[size_t(i)];
    }
    const double u = double(rng.next() >> 11) * 0x1.0p-53 * sum;
    double acc = 0.0;
    for (int i = 0; i < k; i++) {
        acc += w[size_t(i)];
        if (u < acc) return uint32_t(ids[size_t(i)]);
    }
    return uint32_t(ids[size_t(k - 1)]);
}

// "a,b,c" -> token ids (empty text: none), each a non-negative integer below vocab_size; `flag` names
// the option in errors.
inline std::vector<uint32_t> parse_token_ids(const std::string& text, int vocab_size, const char* flag) {
    std::vector<uint32_t> ids;
    if (text.empty()) return ids;
    size_t start = 0;
    for (;;) {
        const size_t comma = text.find(',', start);
        const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        char* end = nullptr;
        errno = 0;
        const long long v = item.empty() ? -1 : std::strtoll(item.c_str(), &end, 10);
        if (item.empty() || errno != 0 || *end != '\0' || v < 0) {
            fail(kExitUsage, "%s '%s': '%s' is not a token id (a non-negative integer)", flag, text.c_str(), item.c_str());
        }
        if (v >= vocab_size) {
            fail(kExitUsage, "%s: token %lld is outside the model's vocabulary [0, %d)", flag, v, vocab_size);
        }
        ids.push_back(uint32_t(v));
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return ids;
}

}  // namespace llmc
