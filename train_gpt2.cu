/*
train_gpt2cu: GPT-2 training on one GPU in mixed precision, in the spirit of llm.c's train_gpt2.cu.

Numbers: parameters, gradients and activations are bf16; LayerNorm statistics, losses, the AdamW moments
and the master weights are fp32; matmuls accumulate in fp32 (cuBLASLt). AdamW updates the fp32 master
weights and rounds them stochastically into the bf16 parameters the model computes with.

This file holds the model (GPT2: its configuration, parameters, gradients, optimizer state and
activations, all allocated once for a micro-batch of B x T; forward, backward and update built from the
layer kernels in llmc/) and main(), which reads top to bottom as the run: parse the flags, build or
load the model, open the data, then loop {next batch, forward, backward, clip, update, log, evaluate,
sample, checkpoint} and write the model. A step talks to the host once: the loss and the gradient norm
come back through one copy into pinned memory.

Checkpoints (-n N: every N steps and at the last) hold everything a bit-exact continuation needs: the
fp32 master weights as an llm.c model file (model.bin), the bf16 parameters (stochastic roundings, not a
function of the master weights), the AdamW moments, the DataLoader position, the step and the settings;
the random streams are functions of (seed, step), so the seeds are all they need. -y 1 resumes from the
newest valid checkpoint in the output directory (llmc/checkpoint.h says what valid means).

Flags use llm.c's letters for the settings the two programs share (-i -j -e -o -b -t -d -l -u -q -c -x
-v -m -s -g -n -y -k); every flag also has a long name (--help lists them). The flags are parsed and
checked before anything touches CUDA, so a bad command line fails the same way with or without a GPU.

Several GPUs (data parallel, NCCL through llmc/multi_gpu.cuh): with --multi-gpu 1, or when the launcher
(mpirun, srun) or --rank/--world-size say there are several ranks, each rank trains on its own slice
of every batch. -z 0: every rank holds the whole optimizer state; on the last micro-step each layer's
gradients are averaged (all-reduce) on a communication stream as soon as backward has left the layer,
overlapping the layers below. -z 1 (ZeRO-1, the default there): the master weights and AdamW moments
are sharded (llmc/zero.h: buffers padded to W equal shards); the gradients are reduce-scattered after
backward, each rank updates its shard, and the bf16 parameters are all-gathered before the next
forward. The stochastic rounding is keyed by (seed, step, flat index) on every rank, so the ranks hold
identical parameters, and one rank through NCCL computes the same bits as the single-GPU path, which
is left exactly as it was (no NCCL call, the same kernels in the same order). Rank 0 alone prints and
writes files; the losses and the validation loss are averaged over the ranks for the log.

Checkpoints with several ranks: with ZeRO-1 every rank writes its shard of the optimizer state into the
shared output directory and rank 0 publishes the checkpoint once all are written; without it rank 0
writes the whole state. A resume on another number of ranks (or between ZeRO-1 and not) re-shards the
optimizer state from the saved ranges and continues the same sample stream (GPT2::load_checkpoint).

Attention is flash attention (llmc/flash_attention.cuh: memory linear in T, deterministic backward) for
head sizes 64 and 128, which covers every GPT-2 size; other head sizes use the cuBLASLt path.

Does not provide (yet): a KV cache for sampling (each sampled token reruns the forward over the tokens
so far), activation recomputation.
*/
#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <sys/stat.h>

#include "llmc/checkpoint.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/dataloader.h"
#include "llmc/dataloader_gpu.cuh"
#include "llmc/device_file_io.cuh"
#include "llmc/flags.h"
#include "llmc/gpt2.cuh"
#include "llmc/gpt2_config.h"
#include "llmc/model_file.h"
#include "llmc/multi_gpu.cuh"
#include "llmc/rendezvous.h"
#include "llmc/sampler.h"
#include "llmc/schedule.h"
#include "llmc/tokenizer.h"
#include "llmc/utils.h"

namespace llmc {

// ----------------------------------------------------------------------------------------------------
// The command line.

struct Options {
    std::string train_pattern = "data/quickstart_train_*.bin";
    std::string val_pattern = "data/quickstart_val_*.bin";
    std::string model = "d12";
    std::string output_dir = "out";
    int B = 4;
    int T = 1024;
    int64_t total_batch = -1;
    float lr = 3e-4f;
    int warmup = 0;
    float final_lr_fraction = 1.0f;
    float weight_decay = 0.0f;
    int max_steps = -1;
    int val_every = 20;
    int val_max_steps = 20;
    int sample_every = 20;
    int gen_tokens = 64;
    int checkpoint_every = 0;
    int keep_last = 0;
    int keep_every = 0;
    bool checkpoint_async = true;
    bool stochastic_rounding = true;
    bool gemm_tune = true;
    int recompute = 0;
    int resume = 0;
    std::string schedule = "cosine";
    float decay_fraction = 0.2f;
    float grad_clip = 1.0f;
    float beta1 = 0.9f;
    float beta2 = 0.95f;
    float eps = 1e-8f;
    int64_t seed = 1337;
    float temperature = 1.0f;
    int top_k = 0;
    int64_t sample_seed = 42;
    std::string tokenizer = "data/gpt2_tokenizer.bin";
    int64_t data_on_gpu_mib = 1024;
    bool shuffle = true;
    bool save_model = true;
    int log_every = 1;
    // Several GPUs.
    int multi_gpu = -1;  // -1: NCCL when there are several ranks; 0: never; 1: always (also for one rank)
    std::string rendezvous;
    std::string rendezvous_job;
    int rank = -1, world_size = -1, local_rank = -1;
    int zero_stage = -1;  // -1: 1 on the NCCL path, else 0
    double nccl_timeout = kDefaultRendezvousTimeout;
    double hang_timeout = 0;
};

inline Flags make_flags(Options& o) {
    Flags f("train_gpt2cu", "Trains GPT-2 on one GPU, or data parallel on several (NCCL): bf16 parameters, gradients and activations; fp32 master "
                            "weights, AdamW moments, LayerNorm statistics and losses.");
    f.add("i", "train", &o.train_pattern, "training token shards: a glob or comma-separated globs");
    f.add("j", "val", &o.val_pattern, "validation token shards; \"\" for none");
    f.add("e", "model", &o.model,
          "model to start from: a model file (llm.c v3/v5) or a descriptor d2 d6 d12 d24 d36 d48");
    f.add("o", "output-dir", &o.output_dir,
          "directory for log.jsonl and model.bin (created if missing); \"\" writes nothing");
    f.add("b", "batch-size", &o.B, "micro-batch size B (sequences per forward/backward)");
    f.add("t", "seq-len", &o.T, "sequence length T (at most the model's maxT)");
    f.add("d", "total-batch", &o.total_batch, "tokens per optimizer step over all ranks, a multiple of B*T*ranks (-1: B*T*ranks)");
    f.add("l", "lr", &o.lr, "peak learning rate");
    f.add("u", "warmup", &o.warmup, "learning-rate warmup steps");
    f.add("q", "final-lr-fraction", &o.final_lr_fraction, "final learning rate as a fraction of the peak");
    f.add("c", "weight-decay", &o.weight_decay, "AdamW weight decay (weight matrices only)");
    f.add("x", "max-steps", &o.max_steps, "optimizer steps (-1: one epoch of the training data)");
    f.add("v", "val-every", &o.val_every, "validation loss every N steps and at the end (0: never)");
    f.add("m", "val-max-steps", &o.val_max_steps, "batches per validation (-1: the whole validation set)");
    f.add("s", "sample-every", &o.sample_every, "sample text every N steps and at the end (0: never)");
    f.add("g", "gen-tokens", &o.gen_tokens, "tokens per sample (at most T - 1)");
    f.add("n", "checkpoint-every", &o.checkpoint_every,
          "checkpoint every N steps and at the last (0: never) into <output-dir>/ckpt_<step>/");
    f.add("nk", "keep-last", &o.keep_last, "keep only the newest N checkpoints (0: keep all)");
    f.add("nm", "keep-every", &o.keep_every, "with -nk: also keep forever every checkpoint whose step is a multiple of N");
    f.add("r", "recompute", &o.recompute,
          "1: keep one GELU output instead of one per layer and recompute it in backward (less memory, a little "
          "slower; llm.c's default); 0: keep them all");
    f.add("", "stochastic-rounding", &o.stochastic_rounding,
          "1: bf16 parameters are the master weights rounded stochastically (seeded); 0: rounded to nearest");
    f.add("", "gemm-tune", &o.gemm_tune,
          "1: each matmul shape's first call times cuBLASLt's candidate algorithms that give bitwise the "
          "heuristic's result and keeps the fastest (same numbers, faster; step 1 synchronises); 0: the heuristic's choice");
    f.add("", "checkpoint-async", &o.checkpoint_async,
          "write checkpoints in the background from a device snapshot (0: training waits for the write)");
    f.add("y", "resume", &o.resume, "1: resume from the newest valid checkpoint in the output directory");
    f.add("k", "schedule", &o.schedule, "learning-rate schedule: cosine, linear, constant or wsd");
    f.add("", "decay-fraction", &o.decay_fraction, "wsd: fraction of the steps spent decaying at the end");
    f.add("", "grad-clip", &o.grad_clip, "clip the global gradient norm to this (0: off)");
    f.add("", "beta1", &o.beta1, "AdamW beta1");
    f.add("", "beta2", &o.beta2, "AdamW beta2");
    f.add("", "eps", &o.eps, "AdamW epsilon");
    f.add("", "seed", &o.seed, "seed of initialisation, data order and stochastic rounding");
    f.add("", "temperature", &o.temperature, "sampling temperature (0: greedy)");
    f.add("", "top-k", &o.top_k, "sample from the k most likely tokens (0: all)");
    f.add("", "sample-seed", &o.sample_seed, "seed of the sampler (the same for every sample of a run)");
    f.add("", "tokenizer", &o.tokenizer, "tokenizer file for decoding samples (ids are printed without it)");
    f.add("", "data-on-gpu-mib", &o.data_on_gpu_mib,
          "keep the token shards in GPU memory when they fit in this many MiB (0: stream)");
    f.add("", "shuffle", &o.shuffle, "shuffle the training samples (0: shards in name order, samples in file order)");
    f.add("", "save-model", &o.save_model, "write <output-dir>/model.bin (fp32, llm.c version 3) at the end");
    f.add("", "log-every", &o.log_every, "print the step line every N steps (every step goes to log.jsonl)");
    f.add("", "multi-gpu", &o.multi_gpu,
          "data parallel over NCCL: 1 always (also one rank), 0 never, -1 when the launcher or flags say >1 rank");
    f.add("", "rendezvous", &o.rendezvous,
          "where the ranks meet: file:DIR, DIR or tcp://HOST:PORT (\"\": /tmp on one node, none for one rank)");
    f.add("", "rendezvous-job", &o.rendezvous_job, "name of this launch in the rendezvous (default: from the launcher)");
    f.add("", "rank", &o.rank, "this process's rank (-1: from mpirun/srun's environment, else 0)");
    f.add("", "world-size", &o.world_size, "number of ranks, with --rank (-1: from the environment, else 1)");
    f.add("", "local-rank", &o.local_rank, "this rank's GPU on its node (-1: from the environment, else the rank)");
    f.add("z", "zero-stage", &o.zero_stage,
          "0: every rank holds the whole optimizer state; 1: ZeRO-1 shards it (-1: 1 on the NCCL path)");
    f.add("", "nccl-timeout", &o.nccl_timeout, "seconds to wait for the other ranks at start-up and for NCCL set-up");
    f.add("", "hang-timeout", &o.hang_timeout, "end the run when a step makes no progress for this many seconds (0: never)");
    return f;
}

inline bool is_regular_file(const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Where the model comes from: a file (its header read and checked now, its weights later) or a descriptor.
struct ModelSource {
    GPT2Config config;
    std::string file;  // empty for a new model
    int file_version = 0;
};

inline ModelSource resolve_model(const std::string& model) {
    ModelSource src;
    if (is_regular_file(model)) {
        File f(model, File::Mode::Read);
        ModelFileInfo info = read_model_header(f);
        src.config = info.config;
        src.file = model;
        src.file_version = info.version;
    } else if (model.size() >= 2 && model[0] == 'd' && model.find_first_not_of("0123456789", 1) == std::string::npos) {
        src.config = config_from_descriptor(model);
    } else if (model.find('/') != std::string::npos || model.find('.') != std::string::npos) {
        fail(kExitIo, "-e/--model: model file '%s' does not exist", model.c_str());
    } else {
        fail(kExitUsage, "-e/--model '%s' is neither a model file nor a descriptor (d2, d6, d12, d24, d36, d48)",
             model.c_str());
    }
    std::string problem = gpu_config_problem(src.config);
    if (!problem.empty()) {
        fail(src.file.empty() ? kExitUsage : kExitData, "model '%s': the GPU kernels need %s", model.c_str(),
             problem.c_str());
    }
    return src;
}

// This process's place among the ranks, from the flags and the launcher's environment, checked before
// anything touches CUDA. Leaves o.multi_gpu and o.zero_stage at 0 or 1.
inline RankInfo resolve_ranks(Options& o) {
    if (o.multi_gpu < -1 || o.multi_gpu > 1) fail(kExitUsage, "--multi-gpu %d: must be -1, 0 or 1", o.multi_gpu);
    if (o.zero_stage < -1 || o.zero_stage > 1) fail(kExitUsage, "-z/--zero-stage %d: must be 0 or 1", o.zero_stage);
    if (!(o.nccl_timeout > 0)) fail(kExitUsage, "--nccl-timeout %g: must be positive", o.nccl_timeout);
    if (!(o.hang_timeout >= 0)) fail(kExitUsage, "--hang-timeout %g: must not be negative", o.hang_timeout);
    if (o.rank < -1 || o.world_size < -1 || o.local_rank < -1) {
        fail(kExitUsage, "--rank %d, --world-size %d, --local-rank %d: must not be negative", o.rank, o.world_size,
             o.local_rank);
    }
    if (o.world_size == 0) fail(kExitUsage, "--world-size 0: need at least 1");
    if (o.multi_gpu == 0 && (o.rank >= 0 || o.world_size >= 0 || o.local_rank >= 0)) {
        fail(kExitUsage, "--rank/--world-size/--local-rank need the NCCL path; drop --multi-gpu 0");
    }
    RankFlags flags;
    flags.rank = o.rank;
    flags.world = o.world_size;
    flags.local_rank = o.local_rank;
    flags.job = o.rendezvous_job;
    const RankInfo ranks = detect_ranks(flags);
    if (o.multi_gpu == 0 && ranks.world > 1) {
        fail(kExitUsage, "--multi-gpu 0, but %s says there are %d ranks", ranks.launcher.c_str(), ranks.world);
    }
    const bool multi = o.multi_gpu == 1 || ranks.world > 1;
    if (!multi) {
        if (!o.rendezvous.empty()) fail(kExitUsage, "--rendezvous needs the NCCL path (--multi-gpu 1 or several ranks)");
        if (!o.rendezvous_job.empty()) {
            fail(kExitUsage, "--rendezvous-job needs the NCCL path (--multi-gpu 1 or several ranks)");
        }
        if (o.zero_stage == 1) fail(kExitUsage, "-z/--zero-stage 1 needs the NCCL path (--multi-gpu 1 or several ranks)");
    } else {
        resolve_rendezvous(o.rendezvous, ranks);  // a bad or missing spec fails here, before CUDA
    }
    o.multi_gpu = multi ? 1 : 0;
    if (o.zero_stage == -1) o.zero_stage = multi ? 1 : 0;
    return ranks;
}

// The settings after checking them against each other and the model; everything here is host-only.
struct Plan {
    int grad_accum = 1;
    int64_t tokens_per_step = 0;
    LRSchedule schedule;
    int gen_tokens = 0;
};

inline Plan plan_run(const Options& o, const GPT2Config& c, int world = 1) {
    if (o.B < 1) fail(kExitUsage, "-b/--batch-size %d: must be at least 1", o.B);
    if (o.T < 1) fail(kExitUsage, "-t/--seq-len %d: must be at least 1", o.T);
    if (o.T > c.max_seq_len) {
        fail(kExitUsage, "-t/--seq-len %d is longer than the model's maximum sequence length %d", o.T, c.max_seq_len);
    }
    if (!(o.lr >= 0.0f)) fail(kExitUsage, "-l/--lr %g: must not be negative", double(o.lr));
    if (o.warmup < 0) fail(kExitUsage, "-u/--warmup %d: must not be negative", o.warmup);
    if (!(o.final_lr_fraction >= 0.0f && o.final_lr_fraction <= 1.0f)) {
        fail(kExitUsage, "-q/--final-lr-fraction %g: must be in [0, 1]", double(o.final_lr_fraction));
    }
    if (!(o.weight_decay >= 0.0f)) fail(kExitUsage, "-c/--weight-decay %g: must not be negative", double(o.weight_decay));
    if (o.max_steps < -1) fail(kExitUsage, "-x/--max-steps %d: must be -1 (one epoch) or at least 0", o.max_steps);
    if (o.val_every < 0) fail(kExitUsage, "-v/--val-every %d: must not be negative", o.val_every);
    if (o.val_max_steps != -1 && o.val_max_steps < 1) {
        fail(kExitUsage, "-m/--val-max-steps %d: must be -1 (all) or at least 1", o.val_max_steps);
    }
    if (o.sample_every < 0) fail(kExitUsage, "-s/--sample-every %d: must not be negative", o.sample_every);
    if (o.sample_every > 0 && o.gen_tokens < 1) {
        fail(kExitUsage, "-g/--gen-tokens %d: must be at least 1 when sampling", o.gen_tokens);
    }
    if (o.checkpoint_every < 0) fail(kExitUsage, "-n/--checkpoint-every %d: must not be negative", o.checkpoint_every);
    if (o.recompute != 0 && o.recompute != 1) fail(kExitUsage, "-r/--recompute %d: must be 0 or 1", o.recompute);
    if (o.resume != 0 && o.resume != 1) fail(kExitUsage, "-y/--resume %d: must be 0 or 1", o.resume);
    if (o.keep_last < 0) fail(kExitUsage, "-nk/--keep-last %d: must not be negative", o.keep_last);
    if (o.keep_every < 0) fail(kExitUsage, "-nm/--keep-every %d: must not be negative", o.keep_every);
    if ((o.checkpoint_every > 0 || o.resume == 1) && o.output_dir.empty()) {
        fail(kExitUsage, "%s needs an output directory (-o)", o.resume == 1 ? "-y 1 (resume)" : "-n (checkpoints)");
    }
    if (!(o.decay_fraction >= 0.0f && o.decay_fraction <= 1.0f)) {
        fail(kExitUsage, "--decay-fraction %g: must be in [0, 1]", double(o.decay_fraction));
    }
    if (!(o.grad_clip >= 0.0f)) fail(kExitUsage, "--grad-clip %g: must not be negative", double(o.grad_clip));
    if (!(o.beta1 >= 0.0f && o.beta1 < 1.0f)) fail(kExitUsage, "--beta1 %g: must be in [0, 1)", double(o.beta1));
    if (!(o.beta2 >= 0.0f && o.beta2 < 1.0f)) fail(kExitUsage, "--beta2 %g: must be in [0, 1)", double(o.beta2));
    if (!(o.eps > 0.0f)) fail(kExitUsage, "--eps %g: must be positive", double(o.eps));
    if (o.seed < 0) fail(kExitUsage, "--seed %lld: must not be negative", (long long)o.seed);
    if (!(o.temperature >= 0.0f)) fail(kExitUsage, "--temperature %g: must not be negative", double(o.temperature));
    if (o.top_k < 0) fail(kExitUsage, "--top-k %d: must not be negative", o.top_k);
    if (o.data_on_gpu_mib < 0) {
        fail(kExitUsage, "--data-on-gpu-mib %lld: must not be negative", (long long)o.data_on_gpu_mib);
    }
    if (o.log_every < 1) fail(kExitUsage, "--log-every %d: must be at least 1", o.log_every);
    if (o.train_pattern.empty()) fail(kExitUsage, "-i/--train: no training shards named");

    Plan p;
    const int64_t micro = int64_t(o.B) * o.T * world;  // one micro-step of every rank
    p.tokens_per_step = o.total_batch == -1 ? micro : o.total_batch;
    if (p.tokens_per_step < 1) {
        fail(kExitUsage, "-d/--total-batch %lld: must be -1 (B*T) or positive", (long long)o.total_batch);
    }
    if (p.tokens_per_step % micro != 0) {
        if (world == 1) {
            fail(kExitUsage, "-d/--total-batch %lld is not a multiple of B*T = %d*%d = %lld tokens (one GPU)",
                 (long long)p.tokens_per_step, o.B, o.T, (long long)micro);
        }
        fail(kExitUsage, "-d/--total-batch %lld is not a multiple of B*T*ranks = %d*%d*%d = %lld tokens",
             (long long)p.tokens_per_step, o.B, o.T, world, (long long)micro);
    }
    p.grad_accum = int(p.tokens_per_step / micro);
    p.schedule.kind = LRSchedule::parse_kind(o.schedule);
    p.schedule.lr = o.lr;
    p.schedule.warmup = o.warmup;
    p.schedule.final_fraction = o.final_lr_fraction;
    p.schedule.decay_fraction = o.decay_fraction;
    p.gen_tokens = std::min(o.gen_tokens, o.T - 1);
    return p;
}

// ----------------------------------------------------------------------------------------------------
// Logging.

// log.jsonl in the output directory: one JSON object per line, flushed as written.
class JsonlLog {
public:
    JsonlLog() = default;
    // append: continue an existing log (a resumed run) rather than start a new one.
    JsonlLog(const std::string& path, bool append) {
        if (append && is_regular_file(path)) {
            file_.open(path, File::Mode::ReadWrite);
            const int64_t size = file_.size();
            file_.seek(size);
            // A run killed mid-line leaves a partial record; the next one starts on a line of its own.
            char last = '\n';
            if (size > 0) file_.read_exact_at(&last, 1, size - 1);
            if (last != '\n') file_.write_all("\n", 1);
        } else {
            file_.open(path, File::Mode::Write);
        }
    }
    void write(const std::string& line) {
        if (!file_.is_open()) return;
        std::string l = line + "\n";
        file_.write_all(l.data(), l.size());
    }

private:
    File file_;
};

// JSON has no NaN or infinity; such values go out as null.
inline std::string json_number(double v, const char* fmt = "%.6g") {
    return std::isfinite(v) ? format(fmt, v) : std::string("null");
}

inline void make_directory(const std::string& dir) {
    std::string partial;
    size_t start = 0;
    while (start <= dir.size()) {
        size_t slash = dir.find('/', start);
        if (slash == std::string::npos) slash = dir.size();
        partial = dir.substr(0, slash);
        if (!partial.empty() && ::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
            int e = errno;
            fail(kExitIo, "cannot create output directory '%s': %s", partial.c_str(), std::strerror(e));
        }
        start = slash + 1;
    }
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        fail(kExitIo, "output directory '%s' is not a directory", dir.c_str());
    }
}

inline std::string duration_text(double seconds) {
    if (!(seconds >= 0) || !std::isfinite(seconds)) return "?";
    long s = long(seconds + 0.5);
    if (s >= 3600) return format("%ldh%02ldm", s / 3600, (s / 60) % 60);
    if (s >= 60) return format("%ldm%02lds", s / 60, s % 60);
    return format("%lds", s);
}

inline std::string memory_table(const GPT2& model, size_t data_bytes) {
    const GPT2::Memory m = model.memory();
    std::string out = "+----------------------------------+------------------------------------------+\n";
    out += format("| %-32s | %-40s |\n", "GPU memory", "bytes");
    out += "+----------------------------------+------------------------------------------+\n";
    auto row = [&](const char* what, size_t bytes) {
        out += format("| %-32s | %-40s |\n", what, human_bytes(double(bytes)).c_str());
    };
    row("parameters (bf16)", m.params);
    row("gradients (bf16)", m.grads);
    row("master + AdamW m, v (fp32)", m.optimizer);
    row("activations", m.activations);
    row("activation gradients", m.activation_grads);
    row("scratch + cuBLAS workspace", m.scratch);
    row("model total", m.total());
    row("data loaders (device side)", data_bytes);
    out += "+----------------------------------+------------------------------------------+\n";
    return out;
}

// ----------------------------------------------------------------------------------------------------
// Sampling.

// Generates `n` tokens after an end-of-text token, rerunning the forward on the tokens so far for each
// (B = 1; no KV cache). Synchronises with the GPU per token: it runs between steps, never inside one.
inline std::vector<uint32_t> generate(GPT2& model, int n, uint32_t start, float temperature, int top_k, uint64_t seed,
                                      int* d_tokens, PinnedBuffer& host_row) {
    const GPT2Config& c = model.config();
    std::vector<int> tokens{int(start)};
    std::vector<uint32_t> out;
    std::vector<float> row(size_t(c.vocab_size));
    SplitMix64 rng(seed);
    const floatX* pinned = reinterpret_cast<const floatX*>(host_row.get());
    for (int i = 0; i < n; i++) {
        const int t = int(tokens.size());
        cudaCheck(cudaMemcpyAsync(d_tokens, tokens.data(), size_t(t) * sizeof(int), cudaMemcpyHostToDevice,
                                  model.stream()));
        model.forward(d_tokens, nullptr, 1, t);
        cudaCheck(cudaMemcpyAsync(host_row.get(), model.logits() + size_t(t - 1) * c.padded_vocab_size,
                                  size_t(c.vocab_size) * sizeof(floatX), cudaMemcpyDeviceToHost, model.stream()));
        cudaCheck(cudaStreamSynchronize(model.stream()));
        for (int v = 0; v < c.vocab_size; v++) row[size_t(v)] = __bfloat162float(pinned[v]);
        const uint32_t next = sample_token(row, temperature, top_k, rng);
        tokens.push_back(int(next));
        out.push_back(next);
    }
    return out;
}

// ----------------------------------------------------------------------------------------------------
// The run's pieces, in the order main() calls them.

struct Device {
    std::string name;
    size_t memory = 0;
    double peak_flops = 0;  // dense bf16; 0 when this GPU is not in the table
};

inline void require_gpu() {
    if (cuda_device_count() == 0) {
        fail(kExitCuda, "no CUDA GPU found: train_gpt2cu needs one (./train_gpt2 is the CPU trainer)");
    }
}

inline Device open_device(int device = 0) {
    require_gpu();
    cudaCheck(cudaSetDevice(device));
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, device));
    return Device{prop.name, prop.totalGlobalMem, peak_bf16_flops(prop.name)};
}

inline std::vector<float> initial_parameters(const ModelSource& src, uint64_t seed) {
    std::vector<float> params;
    if (!src.file.empty()) {
        read_model_file(src.file, &params, &src.config);
    } else {
        params.resize(size_t(num_parameters(src.config)));
        init_parameters(src.config, seed, params.data());
    }
    return params;
}

inline DataLoaderConfig loader_config(const std::string& pattern, const Options& o, const GPT2Config& c, bool shuffle,
                                      const RankInfo& ranks) {
    DataLoaderConfig d;
    d.pattern = pattern;
    d.B = o.B;
    d.T = o.T;
    d.rank = ranks.rank;
    d.world = ranks.world;
    d.vocab_size = uint32_t(c.vocab_size);
    d.shuffle = shuffle;
    d.seed = uint64_t(o.seed);
    return d;
}

// The training and validation loaders, and the step counts that follow from the data.
struct Data {
    std::unique_ptr<GpuDataLoader> train, val;
    int max_steps = 0;
    int val_steps = 0;

    Data(const Options& o, const GPT2Config& c, Plan& plan, cudaStream_t stream, const RankInfo& ranks = RankInfo()) {
        const size_t budget = size_t(o.data_on_gpu_mib) << 20;
        train = std::make_unique<GpuDataLoader>(loader_config(o.train_pattern, o, c, o.shuffle, ranks), stream, budget);
        const uint64_t epoch = std::max<uint64_t>(1, train->schedule().batches_per_epoch() / uint64_t(plan.grad_accum));
        max_steps = o.max_steps >= 0 ? o.max_steps : int(std::min<uint64_t>(epoch, INT32_MAX));
        plan.schedule.total = std::max(1, max_steps);
        if (!o.val_pattern.empty() && o.val_every > 0) {
            val = std::make_unique<GpuDataLoader>(loader_config(o.val_pattern, o, c, false, ranks), stream, budget);
            const uint64_t all = std::max<uint64_t>(1, val->schedule().batches_per_epoch());
            val_steps = int(o.val_max_steps == -1 ? std::min<uint64_t>(all, INT32_MAX)
                                                  : std::min<uint64_t>(all, uint64_t(o.val_max_steps)));
        }
    }
    size_t device_bytes() const {
        return (train->resident() ? train->resident_bytes() : 0) + (val && val->resident() ? val->resident_bytes() : 0);
    }
};

inline void print_startup(const Flags& flags, const Options& o, const Plan& plan, const Device& device,
                          const ModelSource& source, const GPT2& model, const Data& data) {
    std::printf("train_gpt2cu on %s (%s, bf16 peak %s)\n", device.name.c_str(), human_bytes(double(device.memory)).c_str(),
                device.peak_flops > 0 ? format("%.0f TFLOP/s", device.peak_flops / 1e12).c_str() : "unknown: MFU n/a");
    std::fputs(flags.settings_table().c_str(), stdout);
    if (MultiGpu* mg = model.multi()) {
        std::printf("data parallel: %d rank(s) (%s), NCCL, %s; rank 0 on GPU %d; every step each rank takes %d of "
                    "the %lld tokens\n", mg->world(), mg->ranks().launcher.c_str(),
                    o.zero_stage == 1 ? "ZeRO-1 (optimizer state sharded, parameters all-gathered)"
                                      : "gradients all-reduced per layer, optimizer state replicated",
                    mg->device(), plan.grad_accum * o.B * o.T, (long long)plan.tokens_per_step);
    }
    std::printf("model: %s, %s, %lld parameters, %.2f GFLOP per token (6N + 6LCT)\n",
                source.file.empty() ? format("new %s (seed %lld)", o.model.c_str(), (long long)o.seed).c_str()
                                    : format("%s (version %d)", source.file.c_str(), source.file_version).c_str(),
                describe(model.config()).c_str(), (long long)model.num_parameters(),
                flops_per_token(model.config(), o.T) / 1e9);
    const uint64_t epoch_batches = std::max<uint64_t>(1, data.train->schedule().batches_per_epoch());
    std::printf("micro-batch %d x %d, %lld tokens per step, %d micro-step(s) per step, %d steps = %.3f epochs of %llu "
                "tokens\n", o.B, o.T, (long long)plan.tokens_per_step, plan.grad_accum, data.max_steps,
                double(data.max_steps) * plan.grad_accum / double(epoch_batches),
                (unsigned long long)data.train->schedule().total_tokens());
    std::printf("train data: %zu shard(s), %s; val data: %s\n", data.train->schedule().shards().size(),
                data.train->resident() ? "on the GPU" : "streamed",
                data.val ? format("%zu shard(s), %d batches per evaluation", data.val->schedule().shards().size(),
                                  data.val_steps).c_str()
                         : "none");
    if (o.checkpoint_every > 0) {
        std::printf("checkpoints: every %d steps into %s/ckpt_<step>/, %s; keep %s%s\n", o.checkpoint_every,
                    o.output_dir.c_str(), o.checkpoint_async ? "written in the background" : "written synchronously",
                    o.keep_last > 0 ? format("the newest %d", o.keep_last).c_str() : "all",
                    o.keep_last > 0 && o.keep_every > 0 ? format(" and every %d-th step", o.keep_every).c_str() : "");
    }
    std::fputs(memory_table(model, data.device_bytes()).c_str(), stdout);
    size_t free_bytes = 0, total_bytes = 0;
    cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
    std::printf("GPU memory in use after allocation (all of it, CUDA context included): %s of %s\n",
                human_bytes(double(total_bytes - free_bytes)).c_str(), human_bytes(double(total_bytes)).c_str());
    std::fflush(stdout);
}

// Where the run's results go: stdout, log.jsonl, and the tokenizer that turns samples into text.
struct Outputs {
    JsonlLog log;
    Tokenizer tokenizer;
    bool have_tokenizer = false;

    Outputs(const Options& o, bool append_log) {
        if (!o.output_dir.empty()) {
            make_directory(o.output_dir);
            log = JsonlLog(o.output_dir + "/log.jsonl", append_log);
        }
        if (o.sample_every > 0) {
            if (is_regular_file(o.tokenizer)) {
                tokenizer = read_tokenizer_bin(o.tokenizer);
                have_tokenizer = true;
            } else {
                std::printf("note: tokenizer '%s' not found; samples are printed as token ids\n", o.tokenizer.c_str());
            }
        }
    }
    std::string text(const std::vector<uint32_t>& ids) const {
        if (have_tokenizer) return tokenizer.decode(ids);
        std::string out;
        for (uint32_t id : ids) out += format("%u ", id);
        return out;
    }
};

// The device and pinned buffers the loop reads results back through, allocated once.
struct LoopBuffers {
    DeviceBuffer<float> step_stats;   // grad norm, then one mean loss per micro-step
    PinnedBuffer step_stats_host;
    DeviceBuffer<float> val_losses;   // one mean loss per validation batch
    PinnedBuffer val_losses_host;
    DeviceBuffer<int> sample_tokens;  // the tokens generated so far
    PinnedBuffer logit_row;           // one row of logits for the sampler
    Event step_done;

    LoopBuffers(const Plan& plan, const Data& data, const GPT2Config& c, int T)
        : step_stats(size_t(1 + plan.grad_accum)), step_stats_host(size_t(1 + plan.grad_accum) * sizeof(float)),
          val_losses(size_t(std::max(1, data.val_steps))),
          val_losses_host(size_t(std::max(1, data.val_steps)) * sizeof(float)), sample_tokens(size_t(T)),
          logit_row(size_t(c.vocab_size) * sizeof(floatX)) {}
};

// The mean validation loss over `steps` batches from the start of the validation set: one copy back.
inline double evaluate(GPT2& model, GpuDataLoader& val, int steps, int B, int T, LoopBuffers& buf) {
    val.reset();
    for (int i = 0; i < steps; i++) {
        DeviceBatch batch = val.next_batch();
        model.forward(batch.inputs, batch.targets, B, T, buf.val_losses.get() + i);
    }
    if (MultiGpu* mg = model.multi()) {
        mg->all_reduce_mean_async(buf.val_losses.get(), size_t(steps), model.stream());
        mg->join(model.stream());
    }
    cudaCheck(cudaMemcpyAsync(buf.val_losses_host.get(), buf.val_losses.get(), size_t(steps) * sizeof(float),
                              cudaMemcpyDeviceToHost, model.stream()));
    cudaCheck(cudaStreamSynchronize(model.stream()));
    const float* l = reinterpret_cast<const float*>(buf.val_losses_host.get());
    double sum = 0.0;
    for (int i = 0; i < steps; i++) sum += double(l[i]);
    return sum / steps;
}

struct StepStats {
    double loss = 0, norm = 0, seconds = 0;
};

// One optimizer step: grad_accum micro-batches forward and backward (gradients accumulate, each loss
// weighted 1/grad_accum), then norm, clip and AdamW on the device. The only wait: the losses and the norm
// copied back together.
inline StepStats train_step(GPT2& model, GpuDataLoader& train, const Options& o, int grad_accum, int step, float lr,
                            LoopBuffers& buf) {
    const auto t0 = std::chrono::steady_clock::now();
    const float dloss = 1.0f / (float(o.B) * float(o.T) * float(grad_accum));
    model.zero_grad();
    for (int micro = 0; micro < grad_accum; micro++) {
        DeviceBatch batch = train.next_batch();
        model.forward(batch.inputs, batch.targets, o.B, o.T, buf.step_stats.get() + 1 + micro, dloss);
        model.backward(batch.inputs, o.B, o.T, micro + 1 == grad_accum);
    }
    // The logged loss is the mean over ranks (update() waits for it with the gradients).
    if (MultiGpu* mg = model.multi()) mg->all_reduce_mean_async(buf.step_stats.get() + 1, size_t(grad_accum), model.stream());
    AdamWSettings settings;
    settings.learning_rate = lr;
    settings.beta1 = o.beta1;
    settings.beta2 = o.beta2;
    settings.eps = o.eps;
    settings.stochastic_rounding = o.stochastic_rounding;
    settings.weight_decay = o.weight_decay;
    model.update(settings, o.grad_clip, step + 1, uint64_t(o.seed), buf.step_stats.get());
    cudaCheck(cudaMemcpyAsync(buf.step_stats_host.get(), buf.step_stats.get(), size_t(1 + grad_accum) * sizeof(float),
                              cudaMemcpyDeviceToHost, model.stream()));
    cudaCheck(cudaEventRecord(buf.step_done, model.stream()));
    cudaCheck(cudaEventSynchronize(buf.step_done));
    const float* h = reinterpret_cast<const float*>(buf.step_stats_host.get());
    StepStats s;
    s.norm = h[0];
    for (int micro = 0; micro < grad_accum; micro++) s.loss += double(h[1 + micro]);
    s.loss /= grad_accum;
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
}

// Throughput bookkeeping: the first step pays for warm-up (cuBLAS heuristics, caches), so the averages
// and the ETA leave it out when there are others.
struct Throughput {
    double flops_per_token = 0, peak_flops = 0;
    int64_t tokens_per_step = 0;
    double timed_seconds = 0;
    int timed_steps = 0;

    void add(int step, int max_steps, double seconds) {
        if (step > 0 || max_steps == 1) {
            timed_seconds += seconds;
            timed_steps++;
        }
    }
    double seconds_per_step(double fallback) const { return timed_steps > 0 ? timed_seconds / timed_steps : fallback; }
    std::string mfu_text(double tok_per_s, const char* fmt) const {
        const double m = mfu(flops_per_token, tok_per_s, peak_flops);
        return m >= 0 ? format(fmt, 100.0 * m) : std::string("n/a");
    }
};

// After the first step, what --gemm-tune chose (it tunes each matmul shape at its first call).
inline void print_gemm_tuning(const CublasLt& lt) {
    int moved = 0;
    double first = 0, chosen = 0;
    for (const auto& kv : lt.tuned()) {
        if (kv.second.rank != 0) moved++;
        first += kv.second.first_ms;
        chosen += kv.second.chosen_ms;
    }
    std::printf("gemm tuning: %zu matmul shapes timed; %d run a faster algorithm than cuBLASLt's first choice, "
                "with bitwise the same output (one call of each shape: %.2f -> %.2f ms)\n",
                lt.tuned().size(), moved, first, chosen);
}

inline void log_step(Outputs& out, const Throughput& tp, int step, int max_steps, float lr, const StepStats& s,
                     bool print) {
    const double tok_per_s = double(tp.tokens_per_step) / s.seconds;
    const double m = mfu(tp.flops_per_token, tok_per_s, tp.peak_flops);
    if (print) {
        std::printf("step %5d/%d | loss %.6f | lr %.2e | norm %.4f | %.2f ms | %.0f tok/s | MFU %s | ETA %s\n", step + 1,
                    max_steps, s.loss, double(lr), s.norm, s.seconds * 1e3, tok_per_s,
                    tp.mfu_text(tok_per_s, "%.1f%%").c_str(),
                    duration_text(tp.seconds_per_step(s.seconds) * (max_steps - step - 1)).c_str());
        std::fflush(stdout);
    }
    // The loss goes out with 17 digits, enough for the double to read back exactly: logs compare bitwise.
    out.log.write(format("{\"step\":%d,\"loss\":%s,\"lr\":%s,\"norm\":%s,\"ms\":%.3f,\"tok_per_s\":%.1f,\"mfu\":%s}",
                         step + 1, json_number(s.loss, "%.17g").c_str(), json_number(lr, "%.6g").c_str(),
                         json_number(s.norm, "%.9g").c_str(), s.seconds * 1e3, tok_per_s,
                         m >= 0 ? format("%.4f", m).c_str() : "null"));
}

inline void print_sample(GPT2& model, const Options& o, const Plan& plan, const Outputs& out, LoopBuffers& buf,
                         int step) {
    const uint32_t start = out.have_tokenizer ? out.tokenizer.eot()
                                              : std::min(kGpt2EotToken, uint32_t(model.config().vocab_size - 1));
    const std::vector<uint32_t> ids = generate(model, plan.gen_tokens, start, o.temperature, o.top_k,
                                               uint64_t(o.sample_seed), buf.sample_tokens.get(), buf.logit_row);
    std::printf("---------- sample at step %d ----------\n%s\n---------------------------------------\n", step,
                out.text(ids).c_str());
    std::fflush(stdout);
}

// ----------------------------------------------------------------------------------------------------
// Checkpoints and resume.

// Settings a resume must share with the checkpoint: they fix the shapes, the batches and the random
// streams. Everything else may change on resume (see checkpoint_settings).
inline const std::vector<std::string>& resume_must_match() {
    static const std::vector<std::string> keys = {"model", "batch_size", "seq_len", "tokens_per_step", "seed", "shuffle"};
    return keys;
}

// The run's configuration as a checkpoint records it. The keys after the must-match ones may change on
// resume; changing them applies from the resumed step on (the learning rate follows the new schedule at
// the same step, for instance), so only unchanged values continue bit-exactly.
inline std::vector<std::pair<std::string, std::string>> checkpoint_settings(const Options& o, const GPT2Config& c,
                                                                            const Plan& plan, int max_steps) {
    return {
        {"model", describe(c)},
        {"batch_size", format("%d", o.B)},
        {"seq_len", format("%d", o.T)},
        {"tokens_per_step", format("%lld", (long long)plan.tokens_per_step)},
        {"seed", format("%lld", (long long)o.seed)},
        {"shuffle", o.shuffle ? "1" : "0"},
        {"train", o.train_pattern},
        {"val", o.val_pattern},
        {"max_steps", format("%d", max_steps)},
        {"lr", format("%.9g", double(o.lr))},
        {"warmup", format("%d", o.warmup)},
        {"final_lr_fraction", format("%.9g", double(o.final_lr_fraction))},
        {"schedule", o.schedule},
        {"decay_fraction", format("%.9g", double(o.decay_fraction))},
        {"weight_decay", format("%.9g", double(o.weight_decay))},
        {"grad_clip", format("%.9g", double(o.grad_clip))},
        {"beta1", format("%.9g", double(o.beta1))},
        {"beta2", format("%.9g", double(o.beta2))},
        {"eps", format("%.9g", double(o.eps))},
        {"stochastic_rounding", o.stochastic_rounding ? "1" : "0"},
        {"recompute", format("%d", o.recompute)},
        {"sample_seed", format("%lld", (long long)o.sample_seed)},
    };
}

inline CheckpointManifest checkpoint_meta(const Options& o, const GPT2& model, const Plan& plan, const Data& data,
                                          int step, int world) {
    CheckpointManifest m;
    m.settings = checkpoint_settings(o, model.config(), plan, data.max_steps);
    m.settings.push_back({"ranks", format("%d", world)});
    for (auto& kv : model.checkpoint_layout()) m.settings.push_back(std::move(kv));
    // The schedule position is the step; the rate is recorded for the reader's benefit.
    m.settings.push_back({"lr_at_step", format("%.9g", plan.schedule.at(step))});
    m.blobs.push_back({"train_loader", data.train->state()});
    if (data.val) m.blobs.push_back({"val_loader", data.val->state()});
    return m;
}

inline void print_checkpoint_report(const CheckpointReport& r, bool async) {
    std::printf("checkpoint %s: %s in %.2f s (%.2f GB/s), training stalled %.1f ms (%s)%s\n", r.path.c_str(),
                human_bytes(double(r.bytes)).c_str(), r.write_seconds, double(r.bytes) / r.write_seconds / 1e9,
                r.stall_seconds * 1e3, async ? "async" : "sync",
                r.removed.empty() ? "" : format("; removed %zu old", r.removed.size()).c_str());
    for (const std::string& p : r.removed) std::printf("  removed %s\n", p.c_str());
    std::fflush(stdout);
}

// Restores the newest checkpoint in the output directory that loads cleanly and returns its step (0
// when there is none). A checkpoint that fails its checks (truncated, corrupted, missing files) is
// skipped with the reason printed, and the next older one is tried; a configuration or data that
// differs from the checkpoint's is an error, not a reason to skip.
inline int resume_from_checkpoint(const std::vector<CheckpointEntry>& candidates, const Options& o, const Plan& plan,
                                  GPT2& model, Data& data, Outputs& out, int world) {
    if (candidates.empty()) {
        std::printf("resume: no checkpoint in '%s'; starting from step 0\n", o.output_dir.c_str());
        return 0;
    }
    const auto settings = checkpoint_settings(o, model.config(), plan, data.max_steps);
    DeviceFileIO io;
    size_t skipped = 0;
    for (const CheckpointEntry& c : candidates) {
        CheckpointManifest m;
        try {
            m = validate_checkpoint(c.path, /*deep=*/false);
            if (!m.blob("train_loader")) fail(kExitData, "'%s' has no DataLoader state", c.path.c_str());
        } catch (const Error& e) {
            if (e.exit_code() != kExitData && e.exit_code() != kExitIo) throw;
            std::printf("resume: skipping %s: %s\n", c.path.c_str(), e.what());
            skipped++;
            continue;
        }
        std::vector<std::string> notes;
        const std::string diff = settings_differences(m, settings, resume_must_match(), &notes);
        if (!diff.empty()) {
            fail(kExitUsage, "cannot resume from '%s': this run's configuration differs from the checkpoint's: %s",
                 c.path.c_str(), diff.c_str());
        }
        if (m.step > data.max_steps) {
            fail(kExitUsage, "cannot resume from '%s' at step %lld: -x/--max-steps is %d", c.path.c_str(),
                 (long long)m.step, data.max_steps);
        }
        // A run on another number of ranks continues the same sample stream (the DataLoader converts its
        // position; the same tokens per step make that exact) and re-shards the optimizer state.
        int saved_world = 0;
        try {
            saved_world = int(SampleSchedule::state_world(*m.blob("train_loader")));
            data.train->restore(*m.blob("train_loader"), /*allow_world_change=*/true);
        } catch (const Error& e) {
            fail(kExitUsage, "cannot resume from '%s': %s", c.path.c_str(), e.what());
        }
        std::string resharded;
        try {
            resharded = model.load_checkpoint(c.path, m, io);
        } catch (const Error& e) {
            if (e.exit_code() != kExitData && e.exit_code() != kExitIo) throw;
            std::printf("resume: skipping %s: %s\n", c.path.c_str(), e.what());
            skipped++;
            continue;
        }
        for (const std::string& n : notes) std::printf("resume: changed setting %s\n", n.c_str());
        if (saved_world != world) {
            std::printf("resume: the checkpoint was written by %d rank(s), this run has %d: the DataLoader continues "
                        "the same sample stream\n", saved_world, world);
        }
        if (!resharded.empty()) std::printf("resume: %s\n", resharded.c_str());
        std::printf("resume: restored %s%s: step %lld (next step %lld), master weights, bf16 parameters, AdamW m and "
                    "v, DataLoader at batch %llu (epoch %llu), LR schedule at step %lld, seeds (init/rounding %lld, "
                    "sampling %lld)\n",
                    c.path.c_str(), skipped ? format(" (after skipping %zu newer)", skipped).c_str() : "",
                    (long long)m.step, (long long)m.step + 1, (unsigned long long)data.train->position(),
                    (unsigned long long)data.train->epoch(), (long long)m.step, (long long)o.seed,
                    (long long)o.sample_seed);
        std::fflush(stdout);
        out.log.write(format("{\"resume_from_step\":%lld}", (long long)m.step));
        return int(m.step);
    }
    fail(kExitData, "-y 1: none of the %zu checkpoint(s) in '%s' is valid (reasons above); remove them to start over",
         candidates.size(), o.output_dir.c_str());
}

}  // namespace llmc

// ----------------------------------------------------------------------------------------------------

#ifndef TESTING
using namespace llmc;

int main(int argc, char** argv) {
    return run_main([&]() -> int {
        // Flags and the model's shape, checked before anything touches CUDA.
        Options opt;
        Flags flags = make_flags(opt);
        if (!flags.parse(argc, argv)) return kExitOk;
        const ModelSource source = resolve_model(opt.model);
        const RankInfo ranks = resolve_ranks(opt);
        Plan plan = plan_run(opt, source.config, ranks.world);
        const std::vector<CheckpointEntry> candidates =
            opt.resume == 1 ? list_checkpoints(opt.output_dir) : std::vector<CheckpointEntry>();

        // Several GPUs: meet the other ranks (this picks the GPU); rank 0 alone prints and writes files.
        std::unique_ptr<MultiGpu> multi;
        if (opt.multi_gpu == 1) {
            require_gpu();
            MultiGpuOptions mo;
            mo.rendezvous = opt.rendezvous;
            mo.init_timeout_s = opt.nccl_timeout;
            mo.hang_timeout_s = opt.hang_timeout;
            multi = std::make_unique<MultiGpu>(ranks, mo);
        }
        const bool root = ranks.rank == 0;
        if (!root && std::freopen("/dev/null", "w", stdout) == nullptr) {
            fail(kExitIo, "rank %d: cannot silence stdout: %s", ranks.rank, std::strerror(errno));
        }
        const Device device = open_device(multi ? multi->device() : 0);
        Options out_opt = opt;
        if (!root) out_opt.output_dir.clear();
        Outputs out(out_opt, /*append_log=*/!candidates.empty());

        // The model and the data, from the start or from a checkpoint.
        Stream stream;
        GPT2 model(source.config, opt.B, opt.T, stream, multi.get(), opt.zero_stage, opt.recompute == 1);
        model.set_gemm_tuning(opt.gemm_tune);
        if (candidates.empty()) model.set_parameters(initial_parameters(source, uint64_t(opt.seed)));
        Data data(opt, source.config, plan, stream, ranks);
        if (multi) {
            // Ranks started with different settings would train on silently or hang in a collective.
            std::string all = format("zero %d;", opt.zero_stage);
            for (const auto& kv : checkpoint_settings(opt, source.config, plan, data.max_steps)) {
                all += kv.first + "=" + kv.second + ";";
            }
            uint64_t hash = 1469598103934665603ull;  // FNV-1a
            for (unsigned char ch : all) hash = (hash ^ ch) * 1099511628211ull;
            multi->check_same(hash, "the training settings (model, batch, data, schedule, optimizer, seeds)");
        }
        print_startup(flags, opt, plan, device, source, model, data);
        const int start_step = opt.resume == 1 ? resume_from_checkpoint(candidates, opt, plan, model, data, out, ranks.world) : 0;
        // Every rank must have resumed from the same checkpoint (each validated it on its own).
        if (multi && opt.resume == 1) multi->check_same(uint64_t(start_step), "the step resumed from");
        // Made after the model, so that it is destroyed first: no save is in flight when the model goes away.
        std::unique_ptr<Checkpointer> ckpt;
        if (opt.checkpoint_every > 0 && model.sharded() && ranks.world > 1) {
            // ZeRO-1 with several ranks: every rank writes its shard into the shared directory.
            MultiGpu* mg = multi.get();
            ckpt = std::make_unique<Checkpointer>(model.checkpoint_tensors(), opt.checkpoint_async, ranks.rank,
                                                  ranks.world, [mg] { mg->barrier(); }, opt.nccl_timeout);
        } else if (opt.checkpoint_every > 0 && root) {
            // One GPU, or ranks that all hold the whole state: rank 0 alone writes it.
            ckpt = std::make_unique<Checkpointer>(model.checkpoint_tensors(), opt.checkpoint_async);
        }
        if (ckpt) {
            if (ckpt->async()) {
                std::printf("checkpoint snapshot buffers: %s of device memory\n",
                            human_bytes(double(ckpt->snapshot_device_bytes())).c_str());
            }
        }
        LoopBuffers buf(plan, data, source.config, opt.T);
        Throughput tp{flops_per_token(source.config, opt.T), device.peak_flops * ranks.world, plan.tokens_per_step};
        CheckpointReport report;

        // The loop: evaluate and sample between steps (and after the last), train in between.
        double first_val = NAN, last_val = NAN;
        for (int step = start_step; step <= data.max_steps; step++) {
            if (multi) multi->heartbeat();
            const bool last = step == data.max_steps;
            if (data.val && (step % opt.val_every == 0 || last)) {
                last_val = evaluate(model, *data.val, data.val_steps, opt.B, opt.T, buf);
                if (std::isnan(first_val)) first_val = last_val;
                std::printf("step %5d/%d | val loss %.6f\n", step, data.max_steps, last_val);
                out.log.write(format("{\"step\":%d,\"val_loss\":%s}", step, json_number(last_val, "%.9g").c_str()));
            }
            if (root && opt.sample_every > 0 && plan.gen_tokens > 0 &&
                ((step > 0 && step % opt.sample_every == 0) || last)) {
                print_sample(model, opt, plan, out, buf, step);
            }
            if (last) break;
            const float lr = float(plan.schedule.at(step));
            const StepStats s = train_step(model, *data.train, opt, plan.grad_accum, step, lr, buf);
            if (multi) multi->heartbeat();
            tp.add(step, data.max_steps, s.seconds);
            if (root && opt.gemm_tune && step == start_step) print_gemm_tuning(model.cublas());
            log_step(out, tp, step, data.max_steps, lr, s, (step + 1) % opt.log_every == 0 || step + 1 == data.max_steps);
            if (ckpt && ckpt->poll(&report)) print_checkpoint_report(report, ckpt->async());
            if (ckpt && ((step + 1) % opt.checkpoint_every == 0 || step + 1 == data.max_steps)) {
                ckpt->save(opt.output_dir, step + 1, model.checkpoint_tensors(),
                           checkpoint_meta(opt, model, plan, data, step + 1, ranks.world), stream, opt.keep_last,
                           opt.keep_every);
                if (ckpt->poll(&report)) print_checkpoint_report(report, ckpt->async());
            }
        }
        if (ckpt) {
            ckpt->wait();
            if (ckpt->poll(&report)) print_checkpoint_report(report, ckpt->async());
        }

        // The summary and the trained model.
        if (tp.timed_steps > 0) {
            const double tok_per_s = double(tp.tokens_per_step) * tp.timed_steps / tp.timed_seconds;
            std::printf("average over %d steps: %.2f ms/step, %.0f tok/s, MFU %s\n", tp.timed_steps,
                        1e3 * tp.timed_seconds / tp.timed_steps, tok_per_s, tp.mfu_text(tok_per_s, "%.1f%%").c_str());
        }
        if (data.val) std::printf("val loss: %.6f -> %.6f\n", first_val, last_val);
        size_t free_bytes = 0, total_bytes = 0;
        cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
        std::printf("peak GPU memory: %s (all allocated at start; CUDA context included)\n",
                    human_bytes(double(total_bytes - free_bytes)).c_str());
        if (!opt.output_dir.empty() && opt.save_model && (root || model.sharded())) {
            DeviceFileIO io;
            const std::string path = opt.output_dir + "/model.bin";
            model.write_model_file(path, io, root);  // with ZeRO-1 every rank sends its shard
            std::printf("wrote %s (llm.c version 3, fp32 master weights)\n", path.c_str());
        }
        if (multi) multi->barrier();  // no rank tears NCCL down while another still needs it
        return int(kExitOk);
    });
}
#endif
