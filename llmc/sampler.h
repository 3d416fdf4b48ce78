/*
Picking the next token from a row of logits, for the trainers' text samples (train_gpt2cu and the CPU
trainer train_gpt2 share it, so a model samples the same way on either).

Provides:
  sample_token(logits, temperature, top_k, rng): temperature 0 is greedy (the largest logit, the lower
      id on ties); otherwise a draw from softmax(logits / temperature) restricted to the top_k largest
      logits (all of them when top_k is 0 or at least the row's length), computed in double from the
      largest, with one SplitMix64 number per draw, so a seed gives the same tokens on every machine.

Does not provide: nucleus (top-p) sampling, repetition penalties, batched sampling.
*/
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "llmc/rand.h"

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

}  // namespace llmc
