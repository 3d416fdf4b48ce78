/*
The two trainers' command line, from one table: every flag once, with its letter, long name, type,
default, range, help and the trainers that take it (train_gpt2: CPU; train_gpt2cu: GPU). Where they
differ (a default, a range, --gen-tokens' limit) the row says so (cpu ? ... : ...). Test-only flags are
listed apart under "for tests:". Also check_output_flags, the check across flags both trainers make.
*/
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "llmc/flags.h"
#include "llmc/gpt2_config.h"
#include "llmc/rendezvous.h"
#include "llmc/utils.h"

namespace llmc {

enum class Trainer { Cpu, Gpu };

// The flags' fields; trainer_flags() sets every default, also of flags the trainer does not take.
template <Trainer kTrainer>
struct TrainerOptions {
    using Real = std::conditional_t<kTrainer == Trainer::Cpu, double, float>;
    // Both trainers.
    std::string train_pattern, val_pattern, model, output_dir;
    int B, T;
    int64_t total_batch;
    Real lr, final_lr_fraction, weight_decay, decay_fraction, grad_clip, beta1, beta2, eps;
    int warmup, max_steps, val_every, val_max_steps, sample_every, gen_tokens;
    std::string eval_file;
    int eval_every, eval_max_items;
    std::string schedule;
    int64_t seed, sample_seed;
    float temperature;
    int top_k;
    std::string tokenizer, save_model, vocab_dir, prompt, prompt_ids;
    bool shuffle;
    int log_every, max_bad_steps, nan_at_step;
    // train_gpt2 alone: an explicit shape instead of -e.
    int layers, channels, heads, vocab, max_seq_len;
    // train_gpt2cu alone.
    int checkpoint_every, keep_last, keep_every, recompute, resume;
    int64_t rounding_seed;  // -1: seed
    int64_t data_on_gpu_mib;
    bool dry_run;
    float loss_spike;
    std::string time_limit;
    int multi_gpu;  // -1: NCCL when there are several ranks; 0: never; 1: always (also for one rank)
    std::string rendezvous, rendezvous_job;
    int rank, world_size, local_rank;
    int zero_stage;  // -1: 1 on the NCCL path, else 0
    double nccl_timeout, hang_timeout;
};

template <class T>
constexpr T kMax = std::numeric_limits<T>::max();

template <Trainer kTrainer>
inline Flags trainer_flags(TrainerOptions<kTrainer>& o) {
    using Real = typename TrainerOptions<kTrainer>::Real;
    constexpr bool cpu = kTrainer == Trainer::Cpu;
    constexpr unsigned Cpu = 1, Gpu = 2, Both = Cpu | Gpu;
    Flags f = cpu ? Flags("train_gpt2", "Trains GPT-2 on the CPU (fp32 reference model; threads: OMP_NUM_THREADS). "
                                        "Flags as train_gpt2cu's.")
                  : Flags("train_gpt2cu", "Trains GPT-2 on one GPU, or data parallel on several (NCCL): bf16 "
                                          "parameters, gradients and activations; fp32 master weights, AdamW moments, "
                                          "LayerNorm statistics and losses.");
    // A row sets its field's default and adds its flag when it names this trainer (the call compiles for both,
    // so every row's range is checked for both types). range: none, or the bounds lo, hi.
    auto add = [&f](unsigned who, const char* short_name, const char* long_name, auto* field, auto def,
                    const char* help, auto... range) {
        *field = def;
        if (who & (cpu ? Cpu : Gpu)) f.add(short_name, long_name, field, help, range...);
    };
    add(Both, "i", "train", &o.train_pattern, "data/quickstart_train_*.bin",
        "training token shards: a glob or comma-separated globs");
    add(Both, "j", "val", &o.val_pattern, "data/quickstart_val_*.bin", "validation token shards; \"\" for none");
    add(Both, "e", "model", &o.model, cpu ? "d2" : "d12",
        "model to start from: an llm.c model file (v3/v5), a Hugging Face GPT-2 folder (config.json + "
        "safetensors), or a new model d2 d6 d12 d24 d36 d48");
    add(Cpu, "", "layers", &o.layers, 0, "explicit shape instead of -e: layers (with --channels and --heads)", 1, 4096);
    add(Cpu, "", "channels", &o.channels, 0, "explicit shape: channels", 1, 65536);
    add(Cpu, "", "heads", &o.heads, 0, "explicit shape: attention heads", 1, 65536);
    add(Cpu, "", "vocab", &o.vocab, kGPT2VocabSize, "explicit shape: vocabulary size", 1, 1 << 24);
    add(Cpu, "", "max-seq-len", &o.max_seq_len, kGPT2MaxSeqLen, "explicit shape: position embeddings", 1, 1 << 20);
    add(Both, "o", "output-dir", &o.output_dir, "out",
        "directory for log.jsonl, model.bin and (train_gpt2cu) checkpoints, created if missing; \"\" writes nothing");
    add(Both, "b", "batch-size", &o.B, 4, "micro-batch size B (sequences per forward/backward)", 1,
        cpu ? 1 << 16 : kMax<int>);
    add(Both, "t", "seq-len", &o.T, cpu ? 64 : 1024, "sequence length T (at most the model's maxT)", 1,
        cpu ? 1 << 20 : kMax<int>);
    add(Both, "d", "total-batch", &o.total_batch, -1,
        "tokens per optimizer step over all ranks, a multiple of B*T*ranks (-1: B*T*ranks)", -1,
        cpu ? int64_t(1) << 40 : kMax<int64_t>);
    add(Both, "l", "lr", &o.lr, cpu ? 1e-3 : 3e-4, "peak learning rate", 0, cpu ? 10 : kMax<Real>);
    add(Both, "u", "warmup", &o.warmup, 0, "learning-rate warmup steps", 0, cpu ? 1 << 30 : kMax<int>);
    add(Both, "q", "final-lr-fraction", &o.final_lr_fraction, 1, "final learning rate as a fraction of the peak", 0, 1);
    add(Both, "c", "weight-decay", &o.weight_decay, cpu ? 0.1 : 0, "AdamW weight decay (weight matrices only)", 0,
        cpu ? 10 : kMax<Real>);
    add(Both, "x", "max-steps", &o.max_steps, cpu ? 50 : -1,
        "optimizer steps (-1: one epoch of the training data; 0: evaluate and sample only)", -1, kMax<int>);
    add(Both, "v", "val-every", &o.val_every, 20, "validation loss every N steps and at the end (0: never)", 0, kMax<int>);
    add(Both, "m", "val-max-steps", &o.val_max_steps, 20, "batches per validation (-1: the whole validation set)", -1,
        kMax<int>);
    add(Both, "", "eval", &o.eval_file, "",
        "multiple-choice evaluation file (llm.c's eval .bin, e.g. HellaSwag from build/prepare_eval): accuracy "
        "every --eval-every steps and at the end (\"\": none)");
    add(Both, "", "eval-every", &o.eval_every, 250, "evaluate on --eval every N steps and at the end (0: at the end only)",
        0, kMax<int>);
    add(Both, "", "eval-max-items", &o.eval_max_items, -1, "evaluate on the first N items of --eval (-1: all)", -1,
        kMax<int>);
    add(Both, "s", "sample-every", &o.sample_every, 20, "sample text every N steps and at the end (0: never)", 0,
        kMax<int>);
    add(Both, "g", "gen-tokens", &o.gen_tokens, cpu ? 0 : 64,
        cpu ? "tokens per sample (0: no sample; at most maxT minus the prompt)"
            : "tokens per sample (0: no sample; at most T - 1)",
        0, cpu ? 1 << 20 : kMax<int>);
    add(Gpu, "n", "checkpoint-every", &o.checkpoint_every, 0,
        "checkpoint every N steps and at the last (0: never) into <output-dir>/ckpt_<step>/", 0, kMax<int>);
    add(Gpu, "nk", "keep-last", &o.keep_last, 0, "keep only the newest N checkpoints (0: keep all)", 0, kMax<int>);
    add(Gpu, "nm", "keep-every", &o.keep_every, 0,
        "with -nk: also keep forever every checkpoint whose step is a multiple of N", 0, kMax<int>);
    add(Gpu, "r", "recompute", &o.recompute, 0,
        "1: keep one GELU output instead of one per layer and recompute it in backward (less memory, a little "
        "slower; llm.c's default); 0: keep them all", 0, 1);
    add(Gpu, "y", "resume", &o.resume, 0, "1: resume from the newest valid checkpoint in the output directory", 0, 1);
    add(Both, "k", "schedule", &o.schedule, "cosine", "learning-rate schedule: cosine, linear, constant or wsd");
    add(Both, "", "decay-fraction", &o.decay_fraction, 0.2, "wsd: fraction of the steps spent decaying at the end", 0, 1);
    add(Both, "", "grad-clip", &o.grad_clip, 1, "clip the global gradient norm to this (0: off)", 0,
        cpu ? 1e30 : kMax<Real>);
    add(Both, "", "beta1", &o.beta1, 0.9, "AdamW beta1, below 1", 0, cpu ? 0.999999 : 1);
    add(Both, "", "beta2", &o.beta2, 0.95, "AdamW beta2, below 1", 0, cpu ? 0.999999 : 1);
    add(Both, "", "eps", &o.eps, 1e-8, "AdamW epsilon, above 0", cpu ? 1e-30 : 0, cpu ? 1 : kMax<Real>);
    add(Both, "", "seed", &o.seed, 1337,
        "seed of initialisation, data order and (train_gpt2cu) stochastic rounding", 0, kMax<int64_t>);
    add(Gpu, "", "rounding-seed", &o.rounding_seed, -1,
        "seed of the stochastic rounding alone (-1: --seed): another value changes nothing but the rounding "
        "of the bf16 parameters, another run of the same training (the noise a precision change is judged "
        "against)", -1, kMax<int64_t>);
    add(Both, "", "temperature", &o.temperature, 1, "sampling temperature (0: greedy)", 0, cpu ? 1e6f : kMax<float>);
    add(Both, "", "top-k", &o.top_k, 0, "sample from the k most likely tokens (0: all)", 0, kMax<int>);
    const char* sample_seed = "seed of the sampler (the same for every sample of a run)";
    if (cpu) add(Cpu, "", "sample-seed", &o.sample_seed, 42, sample_seed, 0, kMax<int64_t>);
    else add(Gpu, "", "sample-seed", &o.sample_seed, 42, sample_seed);  // any value, taken as a uint64_t
    add(Both, "", "tokenizer", &o.tokenizer, "data/gpt2_tokenizer.bin",
        "tokenizer file for decoding samples (ids are printed without it)");
    add(Gpu, "", "data-on-gpu-mib", &o.data_on_gpu_mib, 1024,
        "keep the token shards in GPU memory when they fit in this many MiB, the training and the validation "
        "shards each (0: stream)", 0, kMax<int64_t>);
    add(Both, "", "shuffle", &o.shuffle, true,
        "shuffle the training samples (0: shards in name order, samples in file order)");
    add(Both, "", "save-model", &o.save_model, "llmc",
        "formats of the trained model written at the end, comma-separated: llmc (<output-dir>/model.bin, fp32, "
        "llm.c v3), llmc-bf16 (model_bf16.bin, v5), hf (hf/: Hugging Face folder, fp32), hf-bf16 (hf_bf16/), "
        "none; with -x 0 only when given");
    add(Both, "", "vocab-dir", &o.vocab_dir, ".deps/gpt2",
        "GPT-2's encoder.json and vocab.bpe: copied into Hugging Face exports, and used to encode --prompt");
    add(Both, "", "prompt", &o.prompt, "", "samples continue this text (needs a build with PCRE2 and --vocab-dir)");
    add(Both, "", "prompt-ids", &o.prompt_ids, "",
        "samples continue these comma-separated token ids (default: <|endoftext|>)");
    add(Both, "", "log-every", &o.log_every, 1, "print the step line every N steps (every step goes to log.jsonl)", 1,
        kMax<int>);
    add(Gpu, "", "dry-run", &o.dry_run, false,
        "1: check the flags, the model and the data, print the plan, and exit without a GPU");
    add(Both, "", "max-bad-steps", &o.max_bad_steps, 8,
        "a step whose loss or gradient norm is not finite is skipped (the model unchanged); stop with exit code 6 "
        "after this many in a row", 1, kMax<int>);
    add(Gpu, "", "loss-spike", &o.loss_spike, 0,
        "also skip an update whose loss is above this many times the mean of the last 50 applied steps (0: off)",
        0, kMax<float>);
    add(Gpu, "", "time-limit", &o.time_limit, "",
        "checkpoint and stop (exit code 7) before this much wall-clock time has passed: seconds, 90m, 23.5h or "
        "H:MM:SS (\"\": no limit)");
    add(Gpu, "", "multi-gpu", &o.multi_gpu, -1,
        "data parallel over NCCL: 1 always (also one rank), 0 never, -1 when the launcher or flags say >1 rank", -1, 1);
    add(Gpu, "", "rendezvous", &o.rendezvous, "",
        "where the ranks meet: file:DIR, DIR or tcp://HOST:PORT (\"\": /tmp on one node, none for one rank)");
    add(Gpu, "", "rendezvous-job", &o.rendezvous_job, "",
        "name of this launch in the rendezvous (default: from the launcher)");
    add(Gpu, "", "rank", &o.rank, -1, "this process's rank (-1: from mpirun/srun's environment, else 0)", -1, kMax<int>);
    add(Gpu, "", "world-size", &o.world_size, -1, "number of ranks, with --rank (-1: from the environment, else 1)", -1,
        kMax<int>);
    add(Gpu, "", "local-rank", &o.local_rank, -1,
        "this rank's GPU on its node (-1: from the environment, else the rank)", -1, kMax<int>);
    add(Gpu, "z", "zero-stage", &o.zero_stage, -1,
        "0: every rank holds the whole optimizer state; 1: ZeRO-1 shards it (-1: 1 on the NCCL path)", -1, 1);
    // At most 1e8 s: the waits count nanoseconds in 64 bits.
    add(Gpu, "", "nccl-timeout", &o.nccl_timeout, kDefaultRendezvousTimeout,
        "seconds to wait for the other ranks at start-up and for NCCL set-up, and for their parts of a checkpoint",
        0, 1e8);
    add(Gpu, "", "hang-timeout", &o.hang_timeout, kDefaultHangTimeout,
        "data parallel: end the run (and abort NCCL) when this rank shows no progress for this many seconds: a "
        "step, a validation, a sample, a checkpoint save or load, start-up (0: never)",
        0, kMax<double>);
    f.group("for tests:");
    add(Both, "", "nan-at-step", &o.nan_at_step, 0, "for tests: make step N's first micro-batch loss NaN (0: never)",
        0, kMax<int>);
    return f;
}

// --save-model naming a format where nothing may be written (-o "") is refused, not silently ignored.
// saves: whether --save-model's value names any format.
inline void check_output_flags(const Flags& flags, const std::string& output_dir, const std::string& save_model,
                               bool saves) {
    if (output_dir.empty() && saves && flags.was_set("save-model")) {
        fail(kExitUsage, "--save-model %s needs an output directory, but -o/--output-dir is \"\" (write nothing): "
             "give -o DIR, or drop --save-model", save_model.c_str());
    }
}

}  // namespace llmc
