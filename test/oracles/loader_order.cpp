/*
Prints the samples the DataLoader (llmc/dataloader.h) hands to one rank (W=1), batch by batch, so that
another reader of the same shards (dev/train_gpt2_torch.py's Shards) can be checked against it sample for
sample; test/test_torch_ref_order.sh does that.

    loader_order -i 'DIR/train_*.bin' -b B -t T --seed S --shuffle 0|1 -n BATCHES

One line per sample, in the order handed out: "batch row shard token_offset checksum", where shard is
the index into the sorted shard list, token_offset the sample's first token in that shard, and checksum
the sum over the sample's T+1 tokens of (i+1) * token[i], so that the tokens themselves are compared too,
not only where they were said to come from. The DataLoader is the trainer's own (no prefetch thread, so
the run is deterministic and small), not a re-implementation of its order.

Does not provide: several ranks (the Python reader handles W=1 only).
*/
#include <cinttypes>
#include <cstdio>
#include <string>

#include "llmc/dataloader.h"
#include "llmc/flags.h"
#include "llmc/utils.h"

using namespace llmc;

namespace {

struct Options {
    std::string pattern;
    int B = 4;
    int T = 64;
    int64_t seed = 1337;
    bool shuffle = true;
    int64_t batches = 10;
    int vocab = 50257;
};

uint64_t row_checksum(const HostBatch& b, int row) {
    uint64_t sum = 0;
    size_t n = size_t(b.T) + 1, first = size_t(row) * n;
    for (size_t i = 0; i < n; i++) {
        uint64_t tok = b.token_bytes == 2 ? static_cast<const uint16_t*>(b.tokens)[first + i]
                                          : static_cast<const uint32_t*>(b.tokens)[first + i];
        sum += (i + 1) * tok;
    }
    return sum;
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&] {
        Options o;
        Flags f("loader_order", "Prints the (shard, token offset, checksum) of every sample the DataLoader hands one rank.");
        f.add("i", "train", &o.pattern, "token shards: a glob or comma-separated globs");
        f.add("b", "batch-size", &o.B, "samples per batch B", 1, 1 << 20);
        f.add("t", "seq-len", &o.T, "tokens per sample's inputs T", 1, 1 << 24);
        f.add("", "seed", &o.seed, "the DataLoader's seed (train_gpt2cu passes its --seed)", int64_t(0), INT64_MAX);
        f.add("", "shuffle", &o.shuffle, "shuffled shard and sample order (0: name order, file order)");
        f.add("n", "batches", &o.batches, "batches to print", int64_t(0), int64_t(1) << 40);
        f.add("", "vocab", &o.vocab, "vocabulary size (token ids are checked against it)", 1, INT32_MAX);
        if (!f.parse(argc, argv)) return 0;
        DataLoaderConfig cfg;
        cfg.pattern = o.pattern;
        cfg.B = o.B;
        cfg.T = o.T;
        cfg.vocab_size = uint32_t(o.vocab);
        cfg.shuffle = o.shuffle;
        cfg.seed = uint64_t(o.seed);
        cfg.prefetch = 0;
        DataLoader loader(cfg);
        std::fprintf(stderr, "loader_order: %s\n", loader.schedule().describe().c_str());
        for (int64_t n = 0; n < o.batches; n++) {
            const HostBatch& b = loader.next();
            for (int r = 0; r < b.B; r++) {
                std::printf("%" PRIu64 " %d %" PRIu32 " %" PRId64 " %" PRIu64 "\n", b.index, r, b.samples[r].shard,
                            b.samples[r].token_offset, row_checksum(b, r));
            }
        }
        return 0;
    });
}
