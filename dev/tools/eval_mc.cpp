/*
eval_mc: scores a model file on a multiple-choice set (llm.c's eval .bin, llmc/mc_eval.h) with the CPU
reference model (cpu/mc_eval_cpu.h), and prints acc and acc_norm. It is the oracle of
test/test_mc_eval_vs_torch.sh (which checks its per-candidate scores against PyTorch) and a way to
evaluate a small model without a GPU.

    eval_mc --model M.bin --eval SET.bin [--batch ROWS] [--seq T] [--items N] [--fp64] [--scores OUT.tsv]

--seq is the number of positions a row may take (default: the model's maxT); longer items keep the last
context tokens (mc_eval.h). --scores writes one line per candidate: item, candidate, label, the sum of
its ending's token losses and its token count (tab-separated, 17 significant digits), then one line per
item with both predictions.

Does not provide: the GPU scoring (the trainers, llmc/mc_eval.cuh) or speed: the CPU model keeps every
activation and takes O(T^2) memory per row.
*/
#include <cstdio>
#include <string>
#include <vector>

#include "cpu/gpt2_cpu.h"
#include "cpu/mc_eval_cpu.h"
#include "llmc/flags.h"
#include "llmc/mc_eval.h"
#include "llmc/model_io.h"
#include "llmc/utils.h"

using namespace llmc;

namespace {

struct Options {
    std::string model, eval, scores;
    int batch = 8;
    int seq = 0;
    int64_t items = 0;
    bool fp64 = false;
};

void write_scores(const std::string& path, const McSet& set, const McResult& r) {
    std::string out = "# item\tcandidate\tlabel\tloss_sum\ttokens\n";
    for (int64_t i = 0; i < r.items; i++) {
        for (int64_t row = r.first_row[size_t(i)]; row < r.first_row[size_t(i + 1)]; row++) {
            out += format("%lld\t%lld\t%d\t%.17g\t%d\n", (long long)i, (long long)(row - r.first_row[size_t(i)]),
                          set.items[size_t(i)].label, r.loss_sum[size_t(row)], r.loss_count[size_t(row)]);
        }
    }
    out += "# item\tpred\tpred_norm\n";
    for (int64_t i = 0; i < r.items; i++) {
        out += format("pred\t%lld\t%d\t%d\n", (long long)i, r.pred[size_t(i)], r.pred_norm[size_t(i)]);
    }
    // Whole or not at all: a failed write keeps an earlier scores file as it was.
    write_file_atomically(path, [&](File& f) { f.write_all(out.data(), out.size()); });
}

template <class Real>
McResult evaluate(const Options& o, const GPT2Config& c, const std::vector<float>& params, const McSet& set) {
    cpu::GPT2<Real> model(c, params);
    return mc_eval_cpu(model, set, o.batch, o.seq);
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&] {
        Options o;
        Flags flags("eval_mc", "Scores a model file on a multiple-choice set with the CPU reference model.");
        flags.add("", "model", &o.model, "the model: an llm.c model file (fp32 or bf16) or a Hugging Face folder")
            .add("", "eval", &o.eval, "the multiple-choice set (llm.c's eval .bin)")
            .add("", "batch", &o.batch, "rows per forward", 1, 4096)
            .add("", "seq", &o.seq, "positions per row (0: the model's maxT)", 0, 1 << 20)
            .add("", "items", &o.items, "score only the first N items (0: all)", 0, kMcMaxExamples)
            .add_switch("", "fp64", &o.fp64, "run the model in double precision")
            .add("", "scores", &o.scores, "write every candidate's score to this file");
        if (!flags.parse(argc, argv)) return kExitOk;
        if (o.model.empty() || o.eval.empty()) fail(kExitUsage, "--model and --eval are needed (see eval_mc --help)");
        const ModelInfo info = probe_model(o.model);
        const std::vector<float> params = load_model_params(o.model, info);
        if (o.seq == 0) o.seq = info.config.max_seq_len;
        McSet set = read_mc_file(o.eval, info.config.vocab_size);
        if (o.items > 0 && o.items < int64_t(set.items.size())) set.items.resize(size_t(o.items));
        const McResult r = o.fp64 ? evaluate<double>(o, info.config, params, set)
                                  : evaluate<float>(o, info.config, params, set);
        std::printf("%s: %lld items, acc %.4f (%lld), acc_norm %.4f (%lld)\n", o.eval.c_str(), (long long)r.items,
                    r.acc(), (long long)r.correct, r.acc_norm(), (long long)r.correct_norm);
        if (!o.scores.empty()) write_scores(o.scores, set, r);
        return kExitOk;
    });
}
