/*
Multiple-choice evaluation (HellaSwag and sets like it): the items, their file format, the GPU's packed
rows (run by mc_eval.cuh) and scoring from the rows' loss sums. The CPU reference model's rows and
scoring are cpu/mc_eval_cpu.h.
An item is a context, K >= 2 candidate endings and the right one's index. A candidate is scored by the
model's token losses on its ending given the context (row = context + ending): acc takes the lowest sum,
acc_norm the lowest mean (llm.c's HellaSwag accuracy); ties go to the lowest index (torch.argmin).
A row has at most T positions: an item that does not fit keeps its last min(context, T + 1 - longest
ending) context tokens for every candidate; an ending longer than T is an error.
File format: llm.c's eval .bin (dev/data/data_common.py write_evalfile): 256 int32 header (magic
20240522, version 1, examples, longest example's bytes), then per example uint16s: 65535, its bytes,
index, label, K, context length and tokens, then K times ending length and tokens. write_mc_file()
checks a set and writes it; read_mc_file() checks every field and names the file, example and byte
offset of what is wrong. HellaSwag's own JSONL is read by prepare_eval (dev/tools/jsonl.h).
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "llmc/hash.h"
#include "llmc/utils.h"

namespace llmc {

constexpr int32_t kMcMagic = 20240522;
constexpr int32_t kMcVersion = 1;
constexpr int kMcHeaderInts = 256;
constexpr int64_t kMcHeaderBytes = kMcHeaderInts * int64_t(sizeof(int32_t));
constexpr uint32_t kMcDelimiter = 65535;     // starts every example; so token ids stay below it
constexpr int64_t kMcMaxExamples = 65535;    // the index field is uint16 (llm.c's writer keeps count < 2^16)
constexpr int64_t kMcMaxExampleBytes = 65534;  // the size field is uint16 and sizes are even
constexpr int kMcExampleFields = 6;          // delimiter, size, index, label, K, context length

struct McItem {
    std::vector<int32_t> context;
    std::vector<std::vector<int32_t>> endings;
    int label = 0;
};

// A set of items and where they came from (named in every error about them).
struct McSet {
    std::string source;
    std::vector<McItem> items;
};

inline int64_t mc_longest_ending(const McItem& item) {
    int64_t longest = 0;
    for (const auto& e : item.endings) longest = std::max(longest, int64_t(e.size()));
    return longest;
}

// Checks what scoring needs of every item (context, >= 2 non-empty endings, a label among them, ids
// below vocab_size) and, with max_T > 0, that every ending fits in max_T positions.
inline void mc_check_items(const McSet& set, int64_t vocab_size, int max_T = 0) {
    const char* src = set.source.c_str();
    if (set.items.empty()) fail(kExitData, "'%s' holds no multiple-choice items", src);
    for (size_t i = 0; i < set.items.size(); i++) {
        const McItem& it = set.items[i];
        // "'SOURCE': item I" + what (" has ..." or ", ...").
        auto bad = [&](const std::string& what) { fail(kExitData, "'%s': item %zu%s", src, i, what.c_str()); };
        if (it.context.empty()) bad(" has an empty context");
        if (it.endings.size() < 2) {
            bad(format(" has %zu candidate ending(s); a choice needs at least 2", it.endings.size()));
        }
        if (it.label < 0 || size_t(it.label) >= it.endings.size()) {
            bad(format(" has label %d, not one of its %zu endings (0..%zu)", it.label, it.endings.size(),
                       it.endings.size() - 1));
        }
        auto check_tokens = [&](const std::vector<int32_t>& t, const std::string& what) {
            for (size_t k = 0; k < t.size(); k++) {
                if (t[k] < 0 || t[k] >= vocab_size) {
                    bad(format(", %s token %zu is %d, outside the vocabulary [0, %lld)", what.c_str(), k, t[k],
                               (long long)vocab_size));
                }
            }
        };
        check_tokens(it.context, "context");
        for (size_t e = 0; e < it.endings.size(); e++) {
            if (it.endings[e].empty()) bad(format(", ending %zu is empty", e));
            check_tokens(it.endings[e], format("ending %zu", e));
        }
        if (max_T > 0 && mc_longest_ending(it) > max_T) {
            bad(format(" has an ending of %lld tokens, more than the %d positions the model is run with; evaluate "
                       "with a longer sequence length, or leave the item out", (long long)mc_longest_ending(it), max_T));
        }
    }
}

// ----------------------------------------------------------------------------------------------------
// The .bin file.

// The example's size in bytes in the file format.
inline int64_t mc_example_bytes(const McItem& item) {
    int64_t values = kMcExampleFields + int64_t(item.context.size());
    for (const auto& e : item.endings) values += 1 + int64_t(e.size());
    return 2 * values;
}

// Writes the set in llm.c's eval format, checked first and written whole or not at all.
inline void write_mc_file(const std::string& path, const McSet& set) {
    const std::vector<McItem>& items = set.items;
    if (int64_t(items.size()) > kMcMaxExamples) {
        fail(kExitUsage, "'%s': %zu items, the format holds at most %lld", path.c_str(), items.size(),
             (long long)kMcMaxExamples);
    }
    // Token ids must stay below the delimiter; mc_check_items names the offending item.
    mc_check_items(set, kMcDelimiter);
    int64_t longest = 0;
    std::vector<uint16_t> stream;
    for (size_t i = 0; i < items.size(); i++) {
        const McItem& it = items[i];
        const int64_t bytes = mc_example_bytes(it);
        if (bytes > kMcMaxExampleBytes) {
            fail(kExitUsage, "'%s': item %zu takes %lld bytes (context of %zu tokens, %zu endings), more than the "
                 "format's %lld per example", path.c_str(), i, (long long)bytes, it.context.size(),
                 it.endings.size(), (long long)kMcMaxExampleBytes);
        }
        longest = std::max(longest, bytes);
        stream.insert(stream.end(), {uint16_t(kMcDelimiter), uint16_t(bytes), uint16_t(i), uint16_t(it.label),
                                     uint16_t(it.endings.size()), uint16_t(it.context.size())});
        for (int32_t t : it.context) stream.push_back(uint16_t(t));
        for (const auto& e : it.endings) {
            stream.push_back(uint16_t(e.size()));
            for (int32_t t : e) stream.push_back(uint16_t(t));
        }
    }
    const int32_t header[kMcHeaderInts] = {kMcMagic, kMcVersion, int32_t(items.size()), int32_t(longest)};
    write_file_atomically(path, [&](File& f) {
        f.write_all(header, sizeof(header));
        f.write_all(stream.data(), stream.size() * sizeof(uint16_t));
    });
}

// Reads and checks a whole eval .bin; token ids must be below vocab_size (at most 65535).
inline McSet read_mc_file(const std::string& path, int64_t vocab_size = kMcDelimiter) {
    vocab_size = std::min<int64_t>(vocab_size, kMcDelimiter);
    const char* p = path.c_str();
    File f(path, File::Mode::Read);
    const int64_t size = f.size();
    if (size < kMcHeaderBytes) {
        fail(kExitData, "eval file '%s' is %lld bytes, shorter than its %lld-byte header (truncated, or not an eval file)",
             p, (long long)size, (long long)kMcHeaderBytes);
    }
    int32_t h[kMcHeaderInts];
    f.read_exact(h, sizeof(h));
    if (h[0] != kMcMagic) {
        const char* hint = h[0] == 20240520 ? " (that is a token shard's magic: evaluation needs a multiple-choice "
                                              "file, see prepare_eval)" : "";
        fail(kExitData, "eval file '%s': bad magic %d at offset 0 (expected %d)%s", p, h[0], kMcMagic, hint);
    }
    if (h[1] != kMcVersion) {
        fail(kExitData, "eval file '%s': unsupported version %d at offset 4 (expected %d)", p, h[1], kMcVersion);
    }
    const int64_t count = h[2];
    if (count < 1 || count > kMcMaxExamples) {
        fail(kExitData, "eval file '%s': example count %lld at offset 8 is not in 1..%lld", p, (long long)count,
             (long long)kMcMaxExamples);
    }
    std::vector<uint16_t> v(size_t((size - kMcHeaderBytes) / 2));
    f.read_exact(v.data(), v.size() * sizeof(uint16_t));
    auto offset = [](int64_t pos) { return (long long)(kMcHeaderBytes + 2 * pos); };

    McSet set{path, {}};
    set.items.resize(size_t(count));
    int64_t pos = 0, longest = 0;
    const int64_t n = int64_t(v.size());
    for (int64_t i = 0; i < count; i++) {
        const long long at = offset(pos);
        // Every error about this example: the file, the example and its offset, then `what`.
        auto bad = [&](const std::string& what) {
            fail(kExitData, "eval file '%s': example %lld at offset %lld: %s", p, (long long)i, at, what.c_str());
        };
        if (pos + kMcExampleFields > n) {
            bad(format("the file (%lld bytes) ends before the example's %d fields; the header (offset 8) promises "
                       "%lld examples (truncated?)", (long long)size, kMcExampleFields, (long long)count));
        }
        if (v[size_t(pos)] != kMcDelimiter) {
            bad(format("expected the delimiter %u, found %u", kMcDelimiter, unsigned(v[size_t(pos)])));
        }
        const int64_t bytes = v[size_t(pos + 1)];
        const int64_t min_bytes = 2 * (kMcExampleFields + 1 + 2 * 2);  // one context token, two 1-token endings
        if (bytes % 2 != 0 || bytes < min_bytes) {
            bad(format("its size field (offset %lld) says %lld bytes; an example takes an even number of bytes, at "
                       "least %lld", offset(pos + 1), (long long)bytes, (long long)min_bytes));
        }
        const int64_t end = pos + bytes / 2;
        if (end > n) {
            bad(format("its size field (offset %lld) says %lld bytes, but the file ends %lld bytes after the "
                       "example's start (truncated?)", offset(pos + 1), (long long)bytes, (long long)(size - at)));
        }
        if (v[size_t(pos + 2)] != i) {
            bad(format("its index field (offset %lld) is %u; examples are numbered 0, 1, 2, ... in file order",
                       offset(pos + 2), unsigned(v[size_t(pos + 2)])));
        }
        McItem& it = set.items[size_t(i)];
        const int label = v[size_t(pos + 3)], k = v[size_t(pos + 4)], ctx = v[size_t(pos + 5)];
        if (k < 2) bad(format("%d candidate ending(s) (offset %lld); a choice needs at least 2", k, offset(pos + 4)));
        if (label >= k) {
            bad(format("label %d (offset %lld) is not one of its %d endings (0..%d)", label, offset(pos + 3), k, k - 1));
        }
        it.label = label;
        // A run of `len` tokens starting at q: within the example, each id below the vocabulary.
        auto take = [&](int64_t q, int64_t len, const std::string& what, std::vector<int32_t>& out) {
            if (len < 1) bad(format("the %s is empty (length field at offset %lld)", what.c_str(), offset(q - 1)));
            if (q + len > end) {
                bad(format("the %s's %lld tokens (length at offset %lld) run past the example's end at offset %lld "
                           "(its size field says %lld bytes)", what.c_str(), (long long)len, offset(q - 1),
                           offset(end), (long long)bytes));
            }
            out.resize(size_t(len));
            for (int64_t j = 0; j < len; j++) {
                const int64_t id = v[size_t(q + j)];
                if (id >= vocab_size) {
                    fail(kExitData, "eval file '%s': example %lld, %s token %lld at offset %lld is %lld, not below "
                         "the vocabulary size %lld", p, (long long)i, what.c_str(), (long long)j, offset(q + j),
                         (long long)id, (long long)vocab_size);
                }
                out[size_t(j)] = int32_t(id);
            }
        };
        take(pos + kMcExampleFields, ctx, "context", it.context);
        int64_t q = pos + kMcExampleFields + ctx;
        it.endings.resize(size_t(k));
        for (int e = 0; e < k; e++) {
            if (q >= end) {
                bad(format("ending %d's length field would be at offset %lld, past the example's end (its size field "
                           "says %lld bytes)", e, offset(q), (long long)bytes));
            }
            take(q + 1, v[size_t(q)], format("ending %d", e), it.endings[size_t(e)]);
            q += 1 + v[size_t(q)];
        }
        if (q != end) {
            bad(format("its size field says %lld bytes, but its fields end after %lld", (long long)bytes,
                       (long long)(2 * (q - pos))));
        }
        longest = std::max(longest, bytes);
        pos = end;
    }
    if (offset(pos) != size) {
        fail(kExitData, "eval file '%s': %lld unexpected bytes after the last of its %lld examples (offset %lld)", p,
             (long long)(size - offset(pos)), (long long)count, offset(pos));
    }
    if (h[3] != longest) {
        fail(kExitData, "eval file '%s': the header's longest-example field (offset 12) says %d bytes, but the longest "
             "example takes %lld", p, h[3], (long long)longest);
    }
    return set;
}

// ----------------------------------------------------------------------------------------------------
// Rows and batches.

// Every candidate of every item is one row: item i's are rows first[i] .. first[i+1]-1.
inline std::vector<int64_t> mc_first_rows(const McSet& set) {
    std::vector<int64_t> first(set.items.size() + 1, 0);
    for (size_t i = 0; i < set.items.size(); i++) first[i + 1] = first[i] + int64_t(set.items[i].endings.size());
    return first;
}

// Context tokens an item keeps in rows of T positions: all that fit beside its longest ending, from the end.
inline int64_t mc_kept_context(const McItem& item, int T) {
    return std::min<int64_t>(int64_t(item.context.size()), int64_t(T) + 1 - mc_longest_ending(item));
}

// A batch's T: its longest row rounded up to a multiple of t_multiple, at most max_T.
inline int mc_rounded_T(int longest, int max_T, int t_multiple) {
    return std::min(max_T, (longest + t_multiple - 1) / t_multiple * t_multiple);
}

// The items rank `rank` of `world` evaluates: a contiguous range, sizes differing by at most one.
inline std::pair<int64_t, int64_t> mc_rank_items(int64_t items, int rank, int world) {
    return {items * rank / world, items * (rank + 1) / world};
}

// One ending's score: its losses summed in order, in double (every path, so they agree bit for bit).
template <class Loss>
double mc_ending_sum(const Loss* l, int count) {
    double s = 0;
    for (int j = 0; j < count; j++) s += double(l[j]);
    return s;
}

// ----------------------------------------------------------------------------------------------------
// The GPU's layout: packed rows, an item's context once and its endings after it.

// One forward's worth of packed rows: an item's kept context once, then one or more of its endings (each
// without its last token), then padding (token 0), for GPT2::forward_scored:
//   positions: each input's position in its candidate's own row (as in McBatcher's rows);
//   groups:    0 for the context, g for the row's g-th ending, -1 for padding (llmc/attention.cuh);
//   scored / targets: per ending, its scored positions (the context's last, then its own but the last)
//   and the tokens they predict; row / count: its set row number and its number of scored positions.
// Without sharing (one ending per row) it is McBatcher's layout.
struct McPackedBatch {
    int B = 0, T = 0;
    std::vector<int> inputs, positions, groups;
    std::vector<int> scored, targets;
    std::vector<int64_t> row;
    std::vector<int> count;
};

// Cuts the items [begin, end) into packed rows and batches of at most max_cells positions and max_cells
// scored ones. With share a row takes as many of an item's endings as fit in max_T; without, one.
class McPackedBatcher {
public:
    McPackedBatcher(const McSet& set, int64_t begin, int64_t end, int max_T, int t_multiple, int64_t vocab_size,
                    int64_t max_cells, bool share)
        : set_(set), first_row_(mc_first_rows(set)), item_(begin), end_(end), max_T_(max_T),
          t_multiple_(std::max(1, t_multiple)), max_cells_(max_cells), share_(share) {
        if (max_T < 1) fail(kExitUsage, "McPackedBatcher: T=%d, need >= 1", max_T);
        if (max_cells < max_T) {
            fail(kExitUsage, "McPackedBatcher: max_cells %lld is below max_T %d", (long long)max_cells, max_T);
        }
        if (max_cells > std::numeric_limits<int32_t>::max()) {
            fail(kExitUsage, "McPackedBatcher: max_cells %lld; positions are int32", (long long)max_cells);
        }
        if (begin < 0 || begin > end || end > int64_t(set.items.size())) {
            fail(kExitUsage, "McPackedBatcher: items [%lld, %lld) of %zu", (long long)begin, (long long)end,
                 set.items.size());
        }
        mc_check_items(set, vocab_size, max_T);
    }

    // Fills b with the next batch; false when the range is done.
    bool next(McPackedBatch& b) {
        struct Row {
            int64_t item;
            int kept, first_ending, endings;
        };
        std::vector<Row> rows;
        int longest = 0;
        int64_t batch_scored = 0;
        while (item_ < end_) {
            const McItem& it = set_.items[size_t(item_)];
            const int kept = int(mc_kept_context(it, max_T_));
            // This row: endings [cand_, last) of the item, as many as fit in max_T positions with at most
            // max_T scored (at least one, by mc_kept_context).
            int length = kept, scored = 0, last = cand_;
            while (last < int(it.endings.size()) && (last == cand_ || share_)) {
                const int n = int(it.endings[size_t(last)].size());
                if (last > cand_ && (length + n - 1 > max_T_ || scored + n > max_T_)) break;
                length += n - 1;
                scored += n;
                last++;
            }
            // The batch: at most max_cells positions and scored ones (the classifier buffers' size).
            if (!rows.empty() && (int64_t(rows.size() + 1) * rounded_T(std::max(longest, length)) > max_cells_ ||
                                  batch_scored + scored > max_cells_)) {
                break;
            }
            rows.push_back({item_, kept, cand_, last - cand_});
            longest = std::max(longest, length);
            batch_scored += scored;
            cand_ = last;
            if (cand_ == int(it.endings.size())) {
                cand_ = 0;
                item_++;
            }
        }
        if (rows.empty()) return false;
        b.B = int(rows.size());
        b.T = rounded_T(longest);
        const size_t cells = size_t(b.B) * size_t(b.T);
        b.inputs.assign(cells, 0);
        b.positions.assign(cells, 0);
        b.groups.assign(cells, -1);
        b.scored.clear();
        b.targets.clear();
        b.row.clear();
        b.count.clear();
        for (int r = 0; r < b.B; r++) {
            const Row& row = rows[size_t(r)];
            const McItem& it = set_.items[size_t(row.item)];
            const int base = r * b.T;
            const int32_t* ctx = it.context.data() + (it.context.size() - size_t(row.kept));
            for (int t = 0; t < row.kept; t++) {
                b.inputs[size_t(base + t)] = ctx[t];
                b.positions[size_t(base + t)] = t;
                b.groups[size_t(base + t)] = 0;
            }
            int at = row.kept;  // where the next ending's tokens go
            for (int g = 0; g < row.endings; g++) {
                const int cand = row.first_ending + g;
                const std::vector<int32_t>& e = it.endings[size_t(cand)];
                const int n = int(e.size());
                b.row.push_back(first_row_[size_t(row.item)] + cand);
                b.count.push_back(n);
                b.scored.push_back(base + row.kept - 1);
                b.targets.push_back(e[0]);
                for (int j = 0; j + 1 < n; j++) {
                    b.inputs[size_t(base + at + j)] = e[size_t(j)];
                    b.positions[size_t(base + at + j)] = row.kept + j;
                    b.groups[size_t(base + at + j)] = share_ ? g + 1 : 0;
                    b.scored.push_back(base + at + j);
                    b.targets.push_back(e[size_t(j + 1)]);
                }
                at += n - 1;
            }
        }
        return true;
    }

private:
    int rounded_T(int longest) const { return mc_rounded_T(longest, max_T_, t_multiple_); }

    const McSet& set_;
    std::vector<int64_t> first_row_;
    int64_t item_, end_;
    int cand_ = 0;
    int max_T_, t_multiple_;
    int64_t max_cells_;
    bool share_;
};

// Sums each ending's losses (losses[i] at b.scored[i]) into loss_sum at its set row number, bit for bit
// as mc_accumulate over McBatcher's rows (cpu/mc_eval_cpu.h).
template <class Loss>
void mc_accumulate_packed(const McPackedBatch& b, const Loss* losses, std::vector<double>& loss_sum) {
    for (size_t e = 0; e < b.row.size(); e++) {
        loss_sum[size_t(b.row[e])] = mc_ending_sum(losses, b.count[e]);
        losses += b.count[e];
    }
}

// ----------------------------------------------------------------------------------------------------
// Scores.

struct McResult {
    int64_t items = 0, correct = 0, correct_norm = 0;
    std::vector<int> pred, pred_norm;  // per item: the candidate chosen by acc and by acc_norm
    std::vector<int64_t> first_row;    // mc_first_rows
    std::vector<double> loss_sum;      // per row: the sum of its ending's token losses
    std::vector<int> loss_count;       // per row: its ending's tokens

    double acc() const { return items > 0 ? double(correct) / double(items) : 0.0; }
    double acc_norm() const { return items > 0 ? double(correct_norm) / double(items) : 0.0; }
    double score(int64_t row, bool norm) const {
        return norm ? loss_sum[size_t(row)] / loss_count[size_t(row)] : loss_sum[size_t(row)];
    }
};

// Picks each item's candidates from the rows' loss sums and counts the right ones.
inline McResult mc_score(const McSet& set, std::vector<double> loss_sum) {
    McResult res;
    res.first_row = mc_first_rows(set);
    if (int64_t(loss_sum.size()) != res.first_row.back()) {
        fail(kExitUsage, "mc_score: %zu row sums for the %lld rows of '%s'", loss_sum.size(),
             (long long)res.first_row.back(), set.source.c_str());
    }
    res.loss_sum = std::move(loss_sum);
    res.items = int64_t(set.items.size());
    res.pred.resize(set.items.size());
    res.pred_norm.resize(set.items.size());
    res.loss_count.resize(res.loss_sum.size());
    for (size_t i = 0; i < set.items.size(); i++) {
        const McItem& it = set.items[i];
        const int64_t r0 = res.first_row[i];
        for (size_t c = 0; c < it.endings.size(); c++) res.loss_count[size_t(r0) + c] = int(it.endings[c].size());
        int best = 0, best_norm = 0;
        for (int c = 1; c < int(it.endings.size()); c++) {
            if (res.score(r0 + c, false) < res.score(r0 + best, false)) best = c;
            if (res.score(r0 + c, true) < res.score(r0 + best_norm, true)) best_norm = c;
        }
        res.pred[i] = best;
        res.pred_norm[i] = best_norm;
        res.correct += best == it.label;
        res.correct_norm += best_norm == it.label;
    }
    return res;
}

// A fingerprint of a set (FNV-1a over labels, lengths and tokens), for the ranks to compare.
inline uint64_t mc_fingerprint(const McSet& set) {
    uint64_t h = kFnv1a64Basis;
    auto mix = [&](int64_t x) { h = fnv1a64(&x, sizeof(x), h); };  // x's 8 bytes, little-endian
    mix(int64_t(set.items.size()));
    for (const McItem& it : set.items) {
        mix(it.label);
        mix(int64_t(it.context.size()));
        for (int32_t t : it.context) mix(t);
        mix(int64_t(it.endings.size()));
        for (const auto& e : it.endings) {
            mix(int64_t(e.size()));
            for (int32_t t : e) mix(t);
        }
    }
    return h;
}

}  // namespace llmc
