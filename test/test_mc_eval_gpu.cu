/*
GPU tests of multiple-choice evaluation (llmc/mc_eval.cuh) against the CPU reference (mc_eval_cpu in
cpu/mc_eval_cpu.h) on the same model and items. Skipped without a GPU.

Both models hold the same numbers: parameters drawn on the host and rounded to bf16 (so the GPU's bf16
weights equal the CPU's fp32 ones), with wte and wpe larger than GPT-2's initialisation (N(0, 0.3)) so
that the logits spread and the candidates of an item score apart. Items: random tokens, 2 to 5 endings
of 1 to 12 tokens, contexts of 1 to 110 tokens, so that some items are longer than T and are cut from
the left, batches hold rows of several items and items straddle batches.

Compared, for both layouts (packed rows: an item's context once, its endings after it with attention
groups; and one row per ending):
  - every candidate's score (sum and mean of its ending's token losses): |gpu - cpu| <= 3e-2 * max(1,
    |cpu|). The GPU rounds activations to bf16 (test_gpt2_gpu.cu measured 5e-3..9e-3 relative on the
    logits), so a wrong row, position, mask or batch layout gives errors of order 1, far above it;
  - predictions: equal for every item except near ties, where the CPU's best and second-best scores are
    closer than twice the largest GPU-CPU difference of any score (those items are listed with their
    margins); the counts of right answers differ by at most the number of near ties; at most a quarter
    of the items may be near ties, so the comparison says something. The worst differences are printed;
  - packed rows against a row per ending on the GPU where packing matters most (contexts of 1-4 tokens,
    four endings of 12-23): every sum within 1.5e-2 relative, while the same batches run without the
    attention groups must be off by 3x that somewhere (so a leak between endings would be seen);
  - reserve(set) allocates every buffer the packed rows need: run(set) allocates nothing more;
  - runs are deterministic (two runs: the same bits) and leave the model's mean_loss() alone;
  - the NCCL path (a MultiGpu from detect_ranks: one rank when run plainly) gives the same bits as the
    single-GPU path with one rank; started as several ranks (mpirun, or OMPI_COMM_WORLD_* set by hand for
    each process) it is compared with the CPU as above, and every rank must hold the same result.
Shapes: d2's (C=128, NH=2, HS=64: flash attention, or the cuBLASLt path with groups for packed rows)
with V=1000, and L=3 C=96 NH=3 (HS=32: the cuBLASLt attention path), at B = 1, 3 and 7 rows; at T=96
and 80 the packed layout splits many items over several rows.
*/
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cpu/gpt2_cpu.h"
#include "cpu/mc_eval_cpu.h"
#include "llmc/dataloader.h"
#include "llmc/mc_eval.cuh"
#include "llmc/model_file.h"
#include "llmc/rendezvous.h"
#include "test/gpu_test.h"
#include "test/test_util.h"

using namespace llmc;

namespace {

constexpr double kTolScore = 3e-2;
constexpr double kMaxNearTieFraction = 0.25;

std::vector<float> test_parameters(const GPT2Config& c, uint64_t seed) {
    std::vector<float> p(size_t(num_parameters(c)));
    init_parameters(c, seed, p.data());
    const auto tensors = param_tensors(c);
    for (int i : {int(kWte), int(kWpe)}) {
        const ParamTensorInfo& t = tensors[size_t(i)];
        for (int64_t j = 0; j < t.numel; j++) {
            p[size_t(t.offset + j)] = float(0.3 * counter_normal(seed + 7, uint64_t(i), uint64_t(j)));
        }
    }
    for (int64_t j = int64_t(c.vocab_size) * c.channels; j < int64_t(c.padded_vocab_size) * c.channels; j++) {
        p[size_t(j)] = 0.0f;
    }
    for (float& x : p) x = bf16_to_float(float_to_bf16(x));
    return p;
}

// Items of random tokens: contexts of context_min..context_max tokens, k_min..k_max endings of
// ending_min..ending_max tokens each.
struct ItemShape {
    int context_min, context_max, k_min, k_max, ending_min, ending_max;
};

McSet random_items(uint64_t seed, int items, int vocab, const char* name, const ItemShape& shape) {
    SplitMix64 rng(seed);
    McSet set{name, {}};
    auto between = [&rng](int lo, int hi) { return lo + (hi > lo ? int(rng.below(uint64_t(hi - lo + 1))) : 0); };
    for (int i = 0; i < items; i++) {
        McItem it;
        it.context = test::random_tokens<int32_t>(size_t(between(shape.context_min, shape.context_max)),
                                                  uint32_t(vocab), rng.next());
        const int k = between(shape.k_min, shape.k_max);
        for (int e = 0; e < k; e++) {
            it.endings.push_back(test::random_tokens<int32_t>(size_t(between(shape.ending_min, shape.ending_max)),
                                                              uint32_t(vocab), rng.next()));
        }
        it.label = int(rng.below(uint64_t(k)));
        set.items.push_back(std::move(it));
    }
    return set;
}

McSet test_items(uint64_t seed, int items, int vocab) {
    return random_items(seed, items, vocab, "random items", {1, 110, 2, 5, 1, 12});
}

double tolerance(double score) { return kTolScore * std::max(1.0, std::abs(score)); }

// The comparison of the file's comment, for one metric (norm: acc_norm). A near tie is an item whose CPU
// margin is below twice the largest GPU-CPU difference of any candidate's score: only there may the two
// rightly disagree.
void compare_metric(const McResult& gpu, const McResult& cpu, bool norm, const char* what) {
    SCOPED_TRACE(what);
    double worst_abs = 0, worst_rel = 0;
    for (size_t r = 0; r < cpu.loss_sum.size(); r++) {
        const double c = cpu.score(int64_t(r), norm), g = gpu.score(int64_t(r), norm);
        worst_abs = std::max(worst_abs, std::abs(g - c));
        worst_rel = std::max(worst_rel, std::abs(g - c) / std::max(1.0, std::abs(c)));
        EXPECT_LE(std::abs(g - c), tolerance(c)) << "row " << r << ": gpu " << g << " cpu " << c;
    }
    int near_ties = 0, disagree = 0;
    for (int64_t i = 0; i < cpu.items; i++) {
        const double margin = mc_margin(cpu, i, norm);
        const int pg = norm ? gpu.pred_norm[size_t(i)] : gpu.pred[size_t(i)];
        const int pc = norm ? cpu.pred_norm[size_t(i)] : cpu.pred[size_t(i)];
        if (margin < 2 * worst_abs) {
            near_ties++;
            std::printf("  %s: item %lld is a near tie: cpu margin %.4g, gpu picks %d, cpu %d\n", what, (long long)i,
                        margin, pg, pc);
        } else {
            EXPECT_EQ(pg, pc) << "item " << i << " (cpu margin " << margin << ")";
        }
        disagree += pg != pc;
    }
    const int64_t gc = norm ? gpu.correct_norm : gpu.correct, cc = norm ? cpu.correct_norm : cpu.correct;
    std::printf("%s: gpu %lld / cpu %lld right of %lld; %d near ties (margin < %.3g), %d disagreements; worst score "
                "error %.3g (%.3e relative, tolerance %.0e)\n", what, (long long)gc, (long long)cc, (long long)cpu.items,
                near_ties, 2 * worst_abs, disagree, worst_abs, worst_rel, kTolScore);
    EXPECT_LE(std::abs(gc - cc), near_ties);
    EXPECT_LE(near_ties, int(kMaxNearTieFraction * double(cpu.items))) << "too many near ties for a meaningful test";
}

void compare(const McResult& gpu, const McResult& cpu) {
    ASSERT_EQ(gpu.items, cpu.items);
    ASSERT_EQ(gpu.first_row, cpu.first_row);
    ASSERT_EQ(gpu.loss_count, cpu.loss_count);
    compare_metric(gpu, cpu, false, "acc");
    compare_metric(gpu, cpu, true, "acc_norm");
}

struct Case {
    const char* name;
    GPT2Config config;
    int T;
};

std::vector<Case> cases() {
    return {{"d2 shape, V=1000 (flash attention)", make_config(2, 128, 2, 1000, 128), 96},
            {"L=3 C=96 NH=3 (cuBLASLt attention)", make_config(3, 96, 3, 1000, 80), 80}};
}

class McEvalGpuTest : public GpuTest {};

TEST_F(McEvalGpuTest, MatchesCpuReference) {
    for (const Case& cs : cases()) {
        SCOPED_TRACE(cs.name);
        std::printf("%s, T=%d\n", cs.name, cs.T);
        const GPT2Config& c = cs.config;
        const std::vector<float> params = test_parameters(c, 42);
        const McSet set = test_items(3, 60, c.vocab_size);
        cpu::GPT2<float> cpu_model(c, params);
        const McResult cpu = mc_eval_cpu(cpu_model, set, 16, cs.T);
        int64_t ending_tokens = 0;
        for (int n : cpu.loss_count) ending_tokens += n;
        for (int B : {1, 3, 7}) {
            Stream stream;
            GPT2 model(c, B, cs.T, stream);
            model.set_parameters(params);
            int64_t run[2] = {0, 0};
            for (bool share : {true, false}) {
                SCOPED_TRACE(format("B=%d, %s", B, share ? "packed rows" : "a row per ending"));
                std::printf("B=%d, %s\n", B, share ? "packed rows" : "a row per ending");
                McEvalGpu eval(model, share);
                const size_t reserved = eval.reserve(set);
                const McResult gpu = eval.run(set);
                compare(gpu, cpu);
                if (share) {
                    EXPECT_GT(reserved, 0u);
                    EXPECT_EQ(model.packed_reserved_bytes(), reserved) << "run() allocated beyond what reserve() did";
                }
                run[share ? 0 : 1] = eval.positions_run();
                EXPECT_EQ(eval.positions_scored(), ending_tokens) << "every ending token scored once";
            }
            std::printf("positions run: %lld packed, %lld a row per ending\n", (long long)run[0], (long long)run[1]);
            EXPECT_LT(run[0], run[1]) << "packing the endings after their context must run fewer positions";
        }
    }
}

// Short contexts (1 to 4 tokens) and four long endings (12 to 23 tokens): in a packed row an ending
// then sits mostly after the other endings, so an ending that saw them (attention without the groups)
// would score far from its own row.
McSet short_context_items(uint64_t seed, int items, int vocab) {
    return random_items(seed, items, vocab, "short contexts, long endings", {1, 4, 4, 4, 12, 23});
}

// McEvalGpu's packed batches of the whole set through forward_scored, by hand: with the batcher's groups,
// or (leak) with every ending's group set to 0, so that each ending also sees the endings before it in
// its row. Every row's sum of losses.
std::vector<double> packed_sums(GPT2& model, const McSet& set, bool leak) {
    McPackedBatcher batcher(set, 0, int64_t(set.items.size()), model.max_T(), McEvalGpu::kTMultiple,
                            model.config().vocab_size, int64_t(model.max_B()) * model.max_T(), true);
    std::vector<double> sums(size_t(mc_first_rows(set).back()), 0.0);
    McPackedBatch b;
    while (batcher.next(b)) {
        std::vector<int> groups = b.groups;
        if (leak) {
            for (int& g : groups) g = g > 0 ? 0 : g;
        }
        using test::upload;  // landed before the model's non-blocking stream reads it
        const DeviceBuffer<int> in = upload(b.inputs), pos = upload(b.positions), grp = upload(groups),
                                sc = upload(b.scored), tg = upload(b.targets);
        const GPT2::PackedRows rows{pos.get(), grp.get()};
        model.forward_scored(in.get(), b.B, b.T, sc.get(), tg.get(), int64_t(b.scored.size()), nullptr, &rows);
        std::vector<float> losses(b.scored.size());
        cudaCheck(cudaStreamSynchronize(model.stream()));
        cudaCheck(cudaMemcpy(losses.data(), model.losses(), losses.size() * sizeof(float), cudaMemcpyDeviceToHost));
        mc_accumulate_packed(b, losses.data(), sums);
    }
    return sums;
}

double worst_relative(const std::vector<double>& a, const std::vector<double>& b) {
    double worst = 0;
    for (size_t r = 0; r < a.size(); r++) worst = std::max(worst, std::abs(a[r] - b[r]) / std::max(1.0, std::abs(b[r])));
    return worst;
}

// Packed rows against a row per ending on the same GPU model, where packing matters most (short contexts,
// long endings): every ending's sum within kTolPacked relative (both runs round to bf16, through
// different attention kernels and matmul shapes), while the same batches with the groups left out
// (each ending seeing the endings before it) must land at least 3 x kTolPacked away somewhere: the
// test can see a leak. The hand-run packed batches equal McEvalGpu's bit for bit. Both against the CPU
// reference as in MatchesCpuReference.
TEST_F(McEvalGpuTest, PackedRowsScoreLikeRowsOfTheirOwn) {
    constexpr double kTolPacked = 1.5e-2;
    for (const Case& cs : cases()) {
        SCOPED_TRACE(cs.name);
        std::printf("%s, T=%d\n", cs.name, cs.T);
        const GPT2Config& c = cs.config;
        // Attention that matters: with GPT-2's initialisation (and wte, wpe at 0.3) the attention adds
        // little to the residual stream, and a leak between endings moved the sums by only ~2e-3. Larger
        // qkv and attproj weights (x5 and x10) make each position's attention output as large as its
        // embedding.
        std::vector<float> params = test_parameters(c, 45);
        const auto tensors = param_tensors(c);
        for (const std::pair<int, float>& scale : {std::pair<int, float>{kQkvw, 5.0f}, {kAttprojw, 10.0f}}) {
            const ParamTensorInfo& t = tensors[size_t(scale.first)];
            for (int64_t j = 0; j < t.numel; j++) {
                float& x = params[size_t(t.offset + j)];
                x = bf16_to_float(float_to_bf16(x * scale.second));
            }
        }
        const McSet set = short_context_items(6, 40, c.vocab_size);
        Stream stream;
        GPT2 model(c, 3, cs.T, stream);
        model.set_parameters(params);
        McEvalGpu packed_eval(model, true), row_eval(model, false);
        const McResult packed = packed_eval.run(set), per_row = row_eval.run(set);
        const std::vector<double> by_hand = packed_sums(model, set, false), leaked = packed_sums(model, set, true);
        EXPECT_EQ(std::memcmp(by_hand.data(), packed.loss_sum.data(), by_hand.size() * sizeof(double)), 0)
            << "the hand-run packed batches differ from McEvalGpu's";
        const double packing = worst_relative(packed.loss_sum, per_row.loss_sum);
        const double leak = worst_relative(leaked, per_row.loss_sum);
        std::printf("worst relative difference from a row per ending: packed %.3e, packed without groups %.3e "
                    "(positions run: %lld packed, %lld a row per ending)\n", packing, leak,
                    (long long)packed_eval.positions_run(), (long long)row_eval.positions_run());
        EXPECT_LE(packing, kTolPacked);
        EXPECT_GE(leak, 3 * kTolPacked) << "leaving the groups out would go unnoticed";
        cpu::GPT2<float> cpu_model(c, params);
        compare(packed, mc_eval_cpu(cpu_model, set, 16, cs.T));
    }
}

TEST_F(McEvalGpuTest, DeterministicAndLeavesTheTrainingLossAlone) {
    const Case cs = cases()[0];
    const GPT2Config& c = cs.config;
    const std::vector<float> params = test_parameters(c, 43);
    const McSet set = test_items(4, 40, c.vocab_size);
    Stream stream;
    GPT2 model(c, 7, cs.T, stream);
    model.set_parameters(params);
    // A forward with targets sets mean_loss(), as a training step does.
    const std::vector<int> tokens = test::random_tokens<int>(size_t(7) * cs.T, uint32_t(c.vocab_size), 5);
    DeviceBuffer<int> d_tokens(tokens.size());
    cudaCheck(cudaMemcpy(d_tokens.get(), tokens.data(), tokens.size() * sizeof(int), cudaMemcpyHostToDevice));
    cudaCheck(cudaDeviceSynchronize());  // landed before the model's non-blocking stream reads it
    model.forward(d_tokens.get(), d_tokens.get(), 7, cs.T);
    float before = 0, after = 0;
    cudaCheck(cudaStreamSynchronize(stream));
    cudaCheck(cudaMemcpy(&before, model.mean_loss(), sizeof(float), cudaMemcpyDeviceToHost));
    McEvalGpu eval(model);
    const McResult a = eval.run(set);
    const McResult b = eval.run(set);
    cudaCheck(cudaMemcpy(&after, model.mean_loss(), sizeof(float), cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(a.loss_sum.data(), b.loss_sum.data(), a.loss_sum.size() * sizeof(double)), 0);
    EXPECT_EQ(a.pred, b.pred);
    EXPECT_EQ(a.pred_norm, b.pred_norm);
    EXPECT_TRUE(std::isfinite(before));
    EXPECT_EQ(std::memcmp(&before, &after, sizeof(float)), 0) << "before " << before << " after " << after;
}

TEST_F(McEvalGpuTest, ErrorsBeforeAnyWork) {
    const Case cs = cases()[0];
    Stream stream;
    GPT2 model(cs.config, 4, 16, stream);
    McEvalGpu eval(model);
    McSet set{"long.bin", {{{1, 2}, {{3}, std::vector<int32_t>(17, 4)}, 0}}};
    try {
        eval.run(set);
        ADD_FAILURE() << "an ending longer than T must be refused";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("'long.bin': item 0 has an ending of 17 tokens, more than the 16"),
                  std::string::npos) << e.what();
    }
    set.items[0].endings[1] = {1000};
    try {
        eval.run(set);
        ADD_FAILURE() << "a token outside the vocabulary must be refused";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("outside the vocabulary [0, 1000)"), std::string::npos) << e.what();
    }
}

// One rank (a plain run): the same bits as the single-GPU path. Several ranks (under a launcher): the
// CPU comparison, and the same result on every rank.
TEST_F(McEvalGpuTest, ThroughNccl) {
    const RankInfo ranks = detect_ranks(RankFlags{});
    MultiGpu multi(ranks, MultiGpuOptions{});
    const Case cs = cases()[0];
    const GPT2Config& c = cs.config;
    const std::vector<float> params = test_parameters(c, 44);
    const McSet set = test_items(5, 61, c.vocab_size);
    Stream stream;
    GPT2 model(c, 5, cs.T, stream, &multi);
    model.set_parameters(params);
    McEvalGpu eval(model);
    const McResult nccl = eval.run(set);
    std::printf("rank %d of %d\n", multi.rank(), multi.world());
    if (multi.world() == 1) {
        GPT2 plain_model(c, 5, cs.T, stream);
        plain_model.set_parameters(params);
        McEvalGpu plain(plain_model);
        const McResult single = plain.run(set);
        EXPECT_EQ(std::memcmp(nccl.loss_sum.data(), single.loss_sum.data(), single.loss_sum.size() * sizeof(double)), 0);
        EXPECT_EQ(nccl.pred, single.pred);
        EXPECT_EQ(nccl.correct_norm, single.correct_norm);
    } else {
        cpu::GPT2<float> cpu_model(c, params);
        compare(nccl, mc_eval_cpu(cpu_model, set, 16, cs.T));
        uint64_t h = 0xcbf29ce484222325ull;
        for (double x : nccl.loss_sum) {
            uint64_t bits;
            std::memcpy(&bits, &x, sizeof(bits));
            h = (h ^ bits) * 0x100000001b3ull;
        }
        EXPECT_NO_THROW(multi.check_same(h, "the evaluation result"));
    }
}

}  // namespace
