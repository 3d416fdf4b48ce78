/*
Multiple-choice evaluation with the CPU reference model (cpu/gpt2_cpu.h), for the CPU trainer, eval_mc
and the tests: McBatcher cuts items into one row per candidate (context + ending), mc_accumulate sums each
ending's losses, mc_eval_cpu() scores a set; mc_margin() says how near to a tie an item's choice was (for
comparing implementations). Items, file format and scoring are llmc/mc_eval.h's; the GPU's packed rows
are llmc/mc_eval.cuh's.
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu/gpt2_cpu.h"
#include "llmc/mc_eval.h"
#include "llmc/utils.h"

namespace llmc {

// One forward's worth of rows: row r at [r*T, (r+1)*T), padded with token 0; its ending's losses at
// positions first[r] .. first[r] + count[r] - 1.
struct McBatch {
    int B = 0, T = 0;
    std::vector<int> inputs, targets;
    std::vector<int64_t> row;  // the set's row number (mc_first_rows) of each batch row
    std::vector<int> first, count;
};

// Cuts the rows of items [begin, end) into batches of at most max_B rows of at most max_T positions (T
// rounded up to a multiple of t_multiple). Checks every item of the set, so every rank fails alike.
class McBatcher {
public:
    McBatcher(const McSet& set, int64_t begin, int64_t end, int max_B, int max_T, int t_multiple, int64_t vocab_size)
        : set_(set), first_row_(mc_first_rows(set)), item_(begin), end_(end), max_B_(max_B), max_T_(max_T),
          t_multiple_(std::max(1, t_multiple)) {
        if (max_B < 1 || max_T < 1) fail(kExitUsage, "McBatcher: B=%d T=%d, need both >= 1", max_B, max_T);
        if (begin < 0 || begin > end || end > int64_t(set.items.size())) {
            fail(kExitUsage, "McBatcher: items [%lld, %lld) of %zu", (long long)begin, (long long)end, set.items.size());
        }
        mc_check_items(set, vocab_size, max_T);
    }

    // Fills b with the next batch; false when the range is done.
    bool next(McBatch& b) {
        b.row.clear();
        b.first.clear();
        b.count.clear();
        std::vector<std::pair<const McItem*, const std::vector<int32_t>*>> rows;  // item, ending
        int longest = 0;
        while (item_ < end_ && int(rows.size()) < max_B_) {
            const McItem& it = set_.items[size_t(item_)];
            const int kept = int(mc_kept_context(it, max_T_));
            const int len = int(it.endings[size_t(cand_)].size());
            rows.push_back({&it, &it.endings[size_t(cand_)]});
            b.row.push_back(first_row_[size_t(item_)] + cand_);
            b.first.push_back(kept - 1);
            b.count.push_back(len);
            longest = std::max(longest, kept + len - 1);
            if (++cand_ == int(it.endings.size())) {
                cand_ = 0;
                item_++;
            }
        }
        if (rows.empty()) return false;
        b.B = int(rows.size());
        b.T = mc_rounded_T(longest, max_T_, t_multiple_);
        b.inputs.assign(size_t(b.B) * size_t(b.T), 0);
        b.targets.assign(size_t(b.B) * size_t(b.T), 0);
        for (int r = 0; r < b.B; r++) {
            const McItem& it = *rows[size_t(r)].first;
            const std::vector<int32_t>& ending = *rows[size_t(r)].second;
            const int kept = b.first[size_t(r)] + 1;
            const int32_t* ctx = it.context.data() + (it.context.size() - size_t(kept));
            // row = ctx[0, kept) + ending: position t reads row[t] and predicts row[t + 1].
            auto token = [&](int t) { return t < kept ? ctx[t] : ending[size_t(t - kept)]; };
            int* in = b.inputs.data() + size_t(r) * size_t(b.T);
            int* tg = b.targets.data() + size_t(r) * size_t(b.T);
            const int n = kept + int(ending.size()) - 1;
            for (int t = 0; t < n; t++) {
                in[t] = token(t);
                tg[t] = token(t + 1);
            }
        }
        return true;
    }

private:
    const McSet& set_;
    std::vector<int64_t> first_row_;
    int64_t item_, end_;
    int cand_ = 0;
    int max_B_, max_T_, t_multiple_;
};

// Sums each batch row's ending losses into loss_sum at the row's set row number.
template <class Loss>
void mc_accumulate(const McBatch& b, const Loss* losses, std::vector<double>& loss_sum) {
    for (int r = 0; r < b.B; r++) {
        const Loss* l = losses + size_t(r) * size_t(b.T) + size_t(b.first[size_t(r)]);
        loss_sum[size_t(b.row[size_t(r)])] = mc_ending_sum(l, b.count[size_t(r)]);
    }
}

// The CPU reference: every row through cpu/gpt2_cpu.h's model in batches of up to max_B rows of at most
// max_T positions; the result does not depend on max_B.
template <class Real>
McResult mc_eval_cpu(cpu::GPT2<Real>& model, const McSet& set, int max_B, int max_T) {
    if (max_T > model.config().max_seq_len) {
        fail(kExitUsage, "multiple-choice eval: T=%d is longer than the model's maxT=%d", max_T,
             model.config().max_seq_len);
    }
    const int64_t items = int64_t(set.items.size());
    McBatcher batcher(set, 0, items, max_B, max_T, 1, model.config().vocab_size);
    std::vector<double> loss_sum(size_t(mc_first_rows(set).back()), 0.0);
    McBatch b;
    while (batcher.next(b)) {
        model.forward(b.inputs.data(), b.targets.data(), b.B, b.T);
        mc_accumulate(b, model.activations().losses.data(), loss_sum);
    }
    return mc_score(set, std::move(loss_sum));
}

// The gap between an item's best and second-best score: within numerical error, two implementations
// may rightly pick different candidates.
inline double mc_margin(const McResult& res, int64_t item, bool norm) {
    std::vector<double> s;
    for (int64_t r = res.first_row[size_t(item)]; r < res.first_row[size_t(item + 1)]; r++) {
        s.push_back(res.score(r, norm));
    }
    std::partial_sort(s.begin(), s.begin() + 2, s.end());
    return s[1] - s[0];
}

}  // namespace llmc
