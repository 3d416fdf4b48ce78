/*
train_gpt2cu: trains GPT-2 on one GPU, or data parallel on several (llmc/multi_gpu.cuh, NCCL), in the
spirit of llm.c's train_gpt2.cu. The model is llmc/gpt2.cuh; this file is the program around it.
main() reads top to bottom as the run: flags, shape and data are checked before anything touches CUDA,
then plan, meet the other ranks, build or load the model, open the data, maybe resume, and loop
{evaluate, sample, train a step, log, checkpoint}. Flags: llmc/trainer_flags.h; design: docs/design.md.
*/
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "llmc/checkpoint.cuh"
#include "llmc/chunk_pipeline.h"
#include "llmc/cuda_utils.cuh"
#include "llmc/dataloader.h"
#include "llmc/dataloader_gpu.cuh"
#include "llmc/device_file_io.cuh"
#include "llmc/gpt2.cuh"
#include "llmc/gpt2_config.h"
#include "llmc/model_file.h"
#include "llmc/mc_eval.cuh"
#include "llmc/mc_eval.h"
#include "llmc/model_io.h"
#include "llmc/multi_gpu.cuh"
#include "llmc/rendezvous.h"
#include "llmc/run_control.h"
#include "llmc/run_log.h"
#include "llmc/run_settings.h"
#include "llmc/prompt.h"
#include "llmc/sampler.h"
#include "llmc/schedule.h"
#include "llmc/tokenizer.h"
#include "llmc/trainer_flags.h"
#include "llmc/utils.h"

namespace llmc {

// ----------------------------------------------------------------------------------------------------
// The command line: the trainers' one flag table (llmc/trainer_flags.h).

using Options = TrainerOptions<Trainer::Gpu>;

// The seed of the bf16 parameters' stochastic rounding: --rounding-seed, or --seed when it is -1.
inline int64_t rounding_seed(const Options& o) { return o.rounding_seed >= 0 ? o.rounding_seed : o.seed; }

// ----------------------------------------------------------------------------------------------------
// The plan: everything derived from the flags, the shape, the ranks and the data, checked before the GPU.

// Where the model comes from: a file or a Hugging Face folder (probed now), or a new model's descriptor.
struct ModelSource {
    GPT2Config config;
    std::string path;  // empty for a new model
    ModelInfo info;
};

inline ModelSource resolve_model(const std::string& model) {
    ModelSource src;
    if (model_path_exists(model)) {
        src.info = probe_model(model);
        src.config = src.info.config;
        src.path = model;
    } else if (model.size() >= 2 && model[0] == 'd' && model.find_first_not_of("0123456789", 1) == std::string::npos) {
        src.config = config_from_descriptor(model);
    } else if (model.find('/') != std::string::npos || model.find('.') != std::string::npos) {
        fail(kExitIo, "-e/--model '%s': %s", model.c_str(), why_not_regular_file(model).c_str());
    } else {
        fail(kExitUsage, "-e/--model '%s' is neither a model file or folder nor a descriptor (d2, d6, d12, d24, d36, d48)",
             model.c_str());
    }
    std::string problem = gpu_config_problem(src.config);
    if (!problem.empty()) {
        fail(src.path.empty() ? kExitUsage : kExitData, "model '%s': the GPU kernels need %s", model.c_str(),
             problem.c_str());
    }
    return src;
}

// This process's place among the ranks, from the flags and the launcher's environment.
struct Parallel {
    RankInfo ranks;
    bool multi = false;  // the NCCL path (also for one rank with --multi-gpu 1)
    int zero_stage = 0;
};

inline Parallel resolve_ranks(const Options& o) {
    if (o.world_size == 0) fail(kExitUsage, "--world-size 0: need at least 1");
    if (!(o.nccl_timeout > 0)) fail(kExitUsage, "--nccl-timeout %g: must be positive", o.nccl_timeout);
    if (o.multi_gpu == 0 && (o.rank >= 0 || o.world_size >= 0 || o.local_rank >= 0)) {
        fail(kExitUsage, "--rank/--world-size/--local-rank need the NCCL path; drop --multi-gpu 0");
    }
    RankFlags flags;
    flags.rank = o.rank;
    flags.world = o.world_size;
    flags.local_rank = o.local_rank;
    flags.job = o.rendezvous_job;
    Parallel p;
    p.ranks = detect_ranks(flags);
    if (o.multi_gpu == 0 && p.ranks.world > 1) {
        fail(kExitUsage, "--multi-gpu 0, but %s says there are %d ranks", p.ranks.launcher.c_str(), p.ranks.world);
    }
    // --rank, --world-size or --local-rank ask for the NCCL path, even for one rank.
    const bool rank_flags = o.rank >= 0 || o.world_size >= 0 || o.local_rank >= 0;
    p.multi = o.multi_gpu == 1 || p.ranks.world > 1 || (o.multi_gpu == -1 && rank_flags);
    if (!p.multi) {
        const char* needs = "needs the NCCL path (--multi-gpu 1 or several ranks)";
        if (!o.rendezvous.empty()) fail(kExitUsage, "--rendezvous %s", needs);
        if (!o.rendezvous_job.empty()) fail(kExitUsage, "--rendezvous-job %s", needs);
        if (o.zero_stage == 1) fail(kExitUsage, "-z/--zero-stage 1 %s", needs);
    } else {
        resolve_rendezvous(o.rendezvous, p.ranks);  // a bad or missing spec fails here, before CUDA
    }
    p.zero_stage = o.zero_stage == -1 ? (p.multi ? 1 : 0) : o.zero_stage;
    return p;
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

// --prompt-ids "1,2,3" or --prompt "text" (encoded with GPT-2's tokenizer when this build has one).
inline std::vector<uint32_t> resolve_prompt(const Options& o, const GPT2Config& c) {
    return prompt_tokens(o.prompt, o.prompt_ids, o.vocab_dir, c.vocab_size);
}

struct Plan {
    GPT2Config config;
    Parallel parallel;
    int grad_accum = 1;
    int64_t tokens_per_step = 0;
    int max_steps = 0;          // -x, or one epoch of the training data
    int val_steps = 0;          // batches per validation (0: no validation)
    LRSchedule schedule;
    int gen_tokens = 0;
    DataLoaderConfig train, val;
    std::vector<std::string> train_shards, val_shards;
    double time_limit_s = 0;  // 0: none
    std::vector<ModelFormat> save_formats;
    std::vector<uint32_t> prompt;  // what samples continue (default: end-of-text)
    McSet eval;                    // --eval's items (none: no evaluation)
    bool evaluate_mc() const { return !eval.items.empty(); }
    uint64_t train_tokens = 0, epoch_batches = 0;  // of the training data (for the start-up lines)
    bool trains() const { return max_steps > 0; }  // -x 0 reads no training data
    bool validate() const { return val_steps > 0; }
};

inline Plan plan_run(const Options& o, const GPT2Config& c, const Parallel& parallel) {
    // The flag table holds each flag's own range; these are the checks across flags and the exclusive bounds.
    if (o.T > c.max_seq_len) {
        fail(kExitUsage, "-t/--seq-len %d is longer than the model's maximum sequence length %d", o.T, c.max_seq_len);
    }
    if (o.val_max_steps == 0) fail(kExitUsage, "-m/--val-max-steps 0: must be -1 (all) or at least 1");
    if (o.eval_max_items == 0) fail(kExitUsage, "--eval-max-items 0: must be -1 (all) or at least 1");
    if ((o.checkpoint_every > 0 || o.resume == 1) && o.output_dir.empty()) {
        fail(kExitUsage, "%s needs an output directory (-o)", o.resume == 1 ? "-y 1 (resume)" : "-n (checkpoints)");
    }
    if (!(o.beta1 < 1.0f)) fail(kExitUsage, "--beta1 %g: must be below 1", double(o.beta1));
    if (!(o.beta2 < 1.0f)) fail(kExitUsage, "--beta2 %g: must be below 1", double(o.beta2));
    if (!(o.eps > 0.0f)) fail(kExitUsage, "--eps %g: must be positive", double(o.eps));
    if (o.train_pattern.empty() && o.max_steps != 0) fail(kExitUsage, "-i/--train: no training shards named");
    if (o.loss_spike != 0.0f && !(o.loss_spike > 1.0f)) {
        fail(kExitUsage, "--loss-spike %g: must be 0 (off) or above 1", double(o.loss_spike));
    }

    Plan p;
    p.config = c;
    p.parallel = parallel;
    const int world = parallel.ranks.world;
    p.tokens_per_step = o.total_batch == -1 ? int64_t(o.B) * o.T * world : o.total_batch;
    if (p.tokens_per_step < 1) {
        fail(kExitUsage, "-d/--total-batch %lld: must be -1 (B*T) or positive", (long long)o.total_batch);
    }
    p.grad_accum = micro_steps_per_step(p.tokens_per_step, o.B, o.T, world);
    p.schedule.kind = LRSchedule::parse_kind(o.schedule);
    p.schedule.lr = o.lr;
    p.schedule.warmup = o.warmup;
    p.schedule.final_fraction = o.final_lr_fraction;
    p.schedule.decay_fraction = o.decay_fraction;
    p.time_limit_s = parse_duration(o.time_limit, "--time-limit");
    p.save_formats = parse_save_formats(o.save_model);
    if (!o.eval_file.empty()) {
        p.eval = read_mc_file(o.eval_file, c.vocab_size);
        if (o.eval_max_items >= 0 && size_t(o.eval_max_items) < p.eval.items.size()) p.eval.items.resize(size_t(o.eval_max_items));
        if (p.eval.items.empty()) fail(kExitData, "--eval '%s' holds no items", o.eval_file.c_str());
        mc_check_items(p.eval, c.vocab_size, o.T);
    }
    p.prompt = resolve_prompt(o, c);
    if (o.sample_every > 0 && o.gen_tokens > 0 && p.prompt.size() >= size_t(o.T)) {
        fail(kExitUsage, "the prompt has %zu tokens; samples need it shorter than -t/--seq-len %d", p.prompt.size(), o.T);
    }
    p.gen_tokens = std::max(0, std::min(o.gen_tokens, o.T - std::max(1, int(p.prompt.size()))));

    // The data's headers are read here so a missing or short split fails before CUDA; -x 0 needs none.
    p.max_steps = o.max_steps;
    if (o.max_steps != 0) {
        p.train = loader_config(o.train_pattern, o, c, o.shuffle, parallel.ranks);
        const SampleSchedule train(p.train);
        for (const ShardInfo& s : train.shards()) p.train_shards.push_back(s.path);
        p.train_tokens = train.total_tokens();
        p.epoch_batches = std::max<uint64_t>(1, train.batches_per_epoch());
        const uint64_t epoch = std::max<uint64_t>(1, train.batches_per_epoch() / uint64_t(p.grad_accum));
        if (o.max_steps == -1) p.max_steps = int(std::min<uint64_t>(epoch, INT32_MAX));
    }
    p.schedule.total = std::max(1, p.max_steps);
    if (!o.val_pattern.empty() && o.val_every > 0) {
        p.val = loader_config(o.val_pattern, o, c, false, parallel.ranks);
        const SampleSchedule val(p.val);
        for (const ShardInfo& s : val.shards()) p.val_shards.push_back(s.path);
        const uint64_t all = std::max<uint64_t>(1, val.batches_per_epoch());
        p.val_steps = int(o.val_max_steps == -1 ? std::min<uint64_t>(all, INT32_MAX)
                                                : std::min<uint64_t>(all, uint64_t(o.val_max_steps)));
    }
    return p;
}

// ----------------------------------------------------------------------------------------------------
// The run's settings, declared once (llmc/run_settings.h): a resume refuses a checkpoint whose MustMatch
// values differ; the ranks of a data-parallel run must agree on all of them.

inline std::vector<RunSetting> run_settings(const Options& o, const Plan& p) {
    auto num = [](double v) { return format("%.9g", v); };
    auto join = [](const std::vector<std::string>& v) {
        std::string s;
        for (const std::string& x : v) s += (s.empty() ? "" : ",") + x;
        return s;
    };
    using R = RunSetting;
    return {
        {"model", describe(p.config), R::MustMatch},
        {"batch_size", format("%d", o.B), R::MustMatch},
        {"seq_len", format("%d", o.T), R::MustMatch},
        {"tokens_per_step", format("%lld", (long long)p.tokens_per_step), R::MustMatch},
        {"seed", format("%lld", (long long)o.seed), R::MustMatch},
        {"shuffle", o.shuffle ? "1" : "0", R::MustMatch},
        {"train", o.train_pattern, R::MayChange},
        {"val", o.val_pattern, R::MayChange},
        {"max_steps", format("%d", p.max_steps), R::MayChange},
        {"lr", num(o.lr), R::MayChange},
        {"warmup", format("%d", o.warmup), R::MayChange},
        {"final_lr_fraction", num(o.final_lr_fraction), R::MayChange},
        {"schedule", o.schedule, R::MayChange},
        {"decay_fraction", num(o.decay_fraction), R::MayChange},
        {"weight_decay", num(o.weight_decay), R::MayChange},
        {"grad_clip", num(o.grad_clip), R::MayChange},
        {"beta1", num(o.beta1), R::MayChange},
        {"beta2", num(o.beta2), R::MayChange},
        {"eps", num(o.eps), R::MayChange},
        // Always on now; still recorded so that resuming a checkpoint written with one off says it changed.
        {"stochastic_rounding", "1", R::MayChange},
        {"classifier_exp", "1", R::MayChange},
        {"rounding_seed", format("%lld", (long long)rounding_seed(o)), R::MayChange},
        {"recompute", format("%d", o.recompute), R::MayChange},
        {"sample_seed", format("%lld", (long long)o.sample_seed), R::MayChange},
        {"zero_stage", format("%d", p.parallel.zero_stage), R::Ranks},
        {"train_shards", join(p.train_shards), R::Ranks},
        {"val_shards", join(p.val_shards), R::Ranks},
        {"val_every", format("%d", o.val_every), R::Ranks},
        {"val_steps", format("%d", p.val_steps), R::Ranks},
        {"sample_every", format("%d", o.sample_every), R::Ranks},
        {"eval", o.eval_file, R::Ranks},
        {"eval_every", format("%d", o.eval_every), R::Ranks},
        {"eval_items", format("%zu", p.eval.items.size()), R::Ranks},
        {"gen_tokens", format("%d", p.gen_tokens), R::Ranks},
        {"checkpoint_every", format("%d", o.checkpoint_every), R::Ranks},
        {"resume", format("%d", o.resume), R::Ranks},
        {"output_dir", o.output_dir, R::Ranks},
        {"save_model", o.save_model, R::Ranks},
        {"data_on_gpu_mib", format("%lld", (long long)o.data_on_gpu_mib), R::Ranks},
        {"hang_timeout", num(o.hang_timeout), R::Ranks},
    };
}

// ----------------------------------------------------------------------------------------------------
// The run's pieces, in the order main() calls them.

// Refuses a run that would not fit in host memory (llmc/run_settings.h), before anything is allocated.
inline void check_host_memory(const Options& o, const Plan& plan) {
    const double params = double(num_parameters(plan.config)) * sizeof(float);
    const double loaders = double(plan.trains()) + double(plan.validate());
    const double batches = loaders * DataLoaderConfig().prefetch * o.B * (o.T + 1.0) *
                           (plan.config.vocab_size <= 65536 ? sizeof(uint16_t) : sizeof(uint32_t));
    const double staging = 3 * 2 * double(kDefaultChunkBytes);
    require_host_memory(params + batches + staging,
                        format("the fp32 parameters %s, batches for -b %d -t %d %s, copy buffers %s",
                               human_bytes(params).c_str(), o.B, o.T, human_bytes(batches).c_str(),
                               human_bytes(staging).c_str()),
                        "use a smaller model, or lower -b or -t");
}

struct Device {
    std::string name;
    size_t memory = 0;
    double peak_flops = 0;  // dense bf16; 0 when this GPU is not in the table
};

inline Device open_device(int device = 0) {
    if (cuda_device_count() == 0) {
        fail(kExitCuda, "no CUDA GPU found: train_gpt2cu needs one (./train_gpt2 is the CPU trainer)");
    }
    cudaCheck(cudaSetDevice(device));
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, device));
    return Device{prop.name, prop.totalGlobalMem, peak_bf16_flops(prop.name)};
}

inline std::unique_ptr<MultiGpu> meet_ranks(const Options& o, const Plan& plan) {
    if (!plan.parallel.multi) return nullptr;
    if (cuda_device_count() == 0) fail(kExitCuda, "no CUDA GPU found: the NCCL path needs one per rank");
    MultiGpuOptions mo;
    mo.rendezvous = o.rendezvous;
    mo.init_timeout_s = o.nccl_timeout;
    mo.hang_timeout_s = o.hang_timeout;
    auto multi = std::make_unique<MultiGpu>(plan.parallel.ranks, mo);
    multi->check_same(settings_hash(run_settings(o, plan)),
                      "the run's settings (model, batch, data, schedule, optimizer, seeds, evaluation, checkpoints)");
    return multi;
}

inline std::vector<float> initial_parameters(const ModelSource& src, uint64_t seed) {
    std::vector<float> params;
    if (!src.path.empty()) {
        params = load_model_params(src.path, src.info);
    } else {
        params.resize(size_t(num_parameters(src.config)));
        init_parameters(src.config, seed, params.data());
    }
    return params;
}

// The training and validation loaders (the plan says what they read).
struct Data {
    std::unique_ptr<GpuDataLoader> train, val;

    Data(const Options& o, const Plan& plan, cudaStream_t stream) {
        const size_t budget = size_t(o.data_on_gpu_mib) << 20;
        if (plan.trains()) train = std::make_unique<GpuDataLoader>(plan.train, stream, budget);
        if (plan.validate()) val = std::make_unique<GpuDataLoader>(plan.val, stream, budget);
    }
    size_t device_bytes() const {
        return (train && train->resident() ? train->resident_bytes() : 0) +
               (val && val->resident() ? val->resident_bytes() : 0);
    }
};

// The lines that say what the run will do; host-only, so --dry-run prints them too.
inline void print_plan(const Flags& flags, const Options& o, const Plan& plan, const ModelSource& source) {
    std::fputs(flags.settings_table().c_str(), stdout);
    if (plan.parallel.multi) {
        std::printf("data parallel: %d rank(s) (%s), NCCL, %s; every step each rank takes %d of the %lld tokens\n",
                    plan.parallel.ranks.world, plan.parallel.ranks.launcher.c_str(),
                    plan.parallel.zero_stage == 1 ? "ZeRO-1 (optimizer state sharded, parameters all-gathered)"
                                                  : "gradients all-reduced per layer, optimizer state replicated",
                    plan.grad_accum * o.B * o.T, (long long)plan.tokens_per_step);
    }
    std::printf("model: %s, %s, %lld parameters, %.2f GFLOP per token (6N + 6LCT)\n",
                source.path.empty() ? format("new %s (seed %lld)", o.model.c_str(), (long long)o.seed).c_str()
                                    : source.info.describe().c_str(),
                describe(plan.config).c_str(), (long long)num_parameters(plan.config),
                flops_per_token(plan.config, o.T) / 1e9);
    if (plan.trains()) {
        std::printf("micro-batch %d x %d, %lld tokens per step, %d micro-step(s) per step, %d steps = %.3f epochs of "
                    "%llu tokens\n", o.B, o.T, (long long)plan.tokens_per_step, plan.grad_accum, plan.max_steps,
                    double(plan.max_steps) * plan.grad_accum / double(plan.epoch_batches),
                    (unsigned long long)plan.train_tokens);
    } else {
        std::printf("micro-batch %d x %d; no training (-x 0)\n", o.B, o.T);
    }
    std::printf("train data: %s; val data: %s\n",
                plan.trains() ? format("%zu shard(s)", plan.train_shards.size()).c_str() : "none",
                plan.validate() ? format("%zu shard(s), %d batches per evaluation", plan.val_shards.size(),
                                         plan.val_steps).c_str()
                                : "none");
    if (plan.evaluate_mc()) {
        std::printf("evaluation: %zu multiple-choice items from %s, %s\n", plan.eval.items.size(), o.eval_file.c_str(),
                    o.eval_every > 0 ? format("every %d steps and at the end", o.eval_every).c_str() : "at the end");
    }
    if (!plan.prompt.empty()) std::printf("prompt: %zu token(s) %s\n", plan.prompt.size(), json_ids(plan.prompt).c_str());
    if (o.checkpoint_every > 0) {
        std::printf("checkpoints: every %d steps into %s/ckpt_<step>/, written in the background; keep %s%s\n",
                    o.checkpoint_every, o.output_dir.c_str(),
                    o.keep_last > 0 ? format("the newest %d", o.keep_last).c_str() : "all",
                    o.keep_last > 0 && o.keep_every > 0 ? format(" and every %d-th step", o.keep_every).c_str() : "");
    }
    std::fflush(stdout);
}

inline std::string memory_table(const GPT2& model, size_t data_bytes) {
    const GPT2::Memory m = model.memory();
    const std::string rule = "+----------------------------------+------------------------------------------+\n";
    std::string out = rule + format("| %-32s | %-40s |\n", "GPU memory", "bytes") + rule;
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
    return out + rule;
}

inline void print_device(const Device& device, const GPT2& model, const Data& data) {
    std::printf("GPU: %s (%s, bf16 peak %s)%s; train data: %s\n", device.name.c_str(),
                human_bytes(double(device.memory)).c_str(),
                device.peak_flops > 0 ? format("%.0f TFLOP/s", device.peak_flops / 1e12).c_str() : "unknown: MFU n/a",
                model.multi() ? format(", rank 0 on GPU %d", model.multi()->device()).c_str() : "",
                !data.train ? "none" : data.train->resident() ? "on the GPU" : "streamed");
    std::fputs(memory_table(model, data.device_bytes()).c_str(), stdout);
    if (model.dw_stream_applies() > 0) {
        std::printf("backward: weight gradients on a second stream (level %d)\n", model.dw_stream_applies());
    }
    std::printf("classifier: %s\n", model.classifier_exp_applies(int64_t(model.max_B()) * model.max_T())
                                        ? "the exp forward on training steps"
                                        : "the exp forward does not apply here (needs sm_90a, B x T a multiple of 128, C "
                                          "of 64): cuBLASLt + fused softmax");
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

    Outputs(const Options& o, bool root, bool append_log) {
        if (root && !o.output_dir.empty()) {
            log = open_run_log(o.output_dir + "/log.jsonl", append_log, o.max_steps == 0, o.model);
        }
        if (o.sample_every > 0) {
            if (regular_file_exists(o.tokenizer)) {
                tokenizer = read_tokenizer_bin(o.tokenizer);
                have_tokenizer = true;
            } else {
                std::printf("note: tokenizer '%s' not found; samples are printed as token ids\n", o.tokenizer.c_str());
            }
        }
    }
    const Tokenizer* tokenizer_or_null() const { return have_tokenizer ? &tokenizer : nullptr; }
    std::string text(const std::vector<uint32_t>& ids) const { return sample_text(tokenizer_or_null(), ids); }
};

// The device and pinned buffers the loop reads results back through, allocated once.
struct LoopBuffers {
    DeviceBuffer<float> step_stats;   // grad norm, one mean loss per micro-step, the update's scale
    PinnedBuffer step_stats_host;
    DeviceBuffer<float> val_losses;   // one mean loss per validation batch
    PinnedBuffer val_losses_host;
    DeviceBuffer<int> sample_tokens;  // the tokens generated so far
    PinnedBuffer logit_row;           // one row of logits for the sampler
    Event step_done;

    LoopBuffers(const Plan& plan, int T)
        : step_stats(size_t(2 + plan.grad_accum)), step_stats_host(size_t(2 + plan.grad_accum) * sizeof(float)),
          val_losses(size_t(std::max(1, plan.val_steps))),
          val_losses_host(size_t(std::max(1, plan.val_steps)) * sizeof(float)), sample_tokens(size_t(T)),
          logit_row(size_t(plan.config.vocab_size) * sizeof(floatX)) {}
};

// ----------------------------------------------------------------------------------------------------
// The loop's steps.

// The mean validation loss over `steps` batches from the start of the validation set: one copy back.
inline double evaluate(GPT2& model, GpuDataLoader& val, int steps, int B, int T, LoopBuffers& buf) {
    val.reset();
    MultiGpu* multi = model.multi();
    for (int i = 0; i < steps; i++) {
        DeviceBatch batch = val.next_batch();
        model.forward(batch.inputs, batch.targets, B, T, buf.val_losses.get() + i);
        // A long validation is progress too: a stuck GPU stops these beats.
        if (multi) multi->heartbeat();
    }
    if (multi) {
        multi->all_reduce_mean_async(buf.val_losses.get(), size_t(steps), model.stream());
        multi->join(model.stream());
    }
    cudaCheck(cudaMemcpyAsync(buf.val_losses_host.get(), buf.val_losses.get(), size_t(steps) * sizeof(float),
                              cudaMemcpyDeviceToHost, model.stream()));
    cudaCheck(cudaStreamSynchronize(model.stream()));
    const float* l = reinterpret_cast<const float*>(buf.val_losses_host.get());
    double sum = 0.0;
    for (int i = 0; i < steps; i++) sum += double(l[i]);
    return sum / steps;
}

// Multiple-choice accuracy (llmc/mc_eval.h), printed and logged.
inline void evaluate_choices(McEvalGpu& mc, const McSet& set, int step, int max_steps, JsonlLog& log) {
    const auto t0 = std::chrono::steady_clock::now();
    const McResult r = mc.run(set);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("step %5d/%d | eval acc %.4f | acc_norm %.4f | %lld items in %.2f s\n", step, max_steps, r.acc(),
                r.acc_norm(), (long long)r.items, seconds);
    log.write(format("{\"step\":%d,\"eval_acc\":%.6f,\"eval_acc_norm\":%.6f,\"eval_items\":%lld,\"eval_s\":%.3f}",
                     step, r.acc(), r.acc_norm(), (long long)r.items, seconds));
}

// Generates `n` tokens after `start`, rerunning the forward on the tokens so far (B = 1; no KV cache).
// Synchronises per token: it runs between steps, never inside one.
inline std::vector<uint32_t> generate(GPT2& model, int n, const std::vector<uint32_t>& start, float temperature,
                                      int top_k, uint64_t seed, int* d_tokens, PinnedBuffer& host_row) {
    const GPT2Config& c = model.config();
    std::vector<int> tokens(start.begin(), start.end());
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

inline void print_sample(GPT2& model, const Options& o, const Plan& plan, Outputs& out, LoopBuffers& buf, int step) {
    // The model's vocabulary may be smaller or larger than the tokenizer's (llmc/prompt.h).
    const std::vector<uint32_t> start = sample_start(plan.prompt, out.tokenizer_or_null(), model.config().vocab_size);
    const std::vector<uint32_t> ids = generate(model, plan.gen_tokens, start, o.temperature, o.top_k,
                                               uint64_t(o.sample_seed), buf.sample_tokens.get(), buf.logit_row);
    std::printf("---------- sample at step %d ----------\n%s%s\n---------------------------------------\n", step,
                plan.prompt.empty() ? "" : format("%s|", out.text(plan.prompt).c_str()).c_str(), out.text(ids).c_str());
    std::fflush(stdout);
    out.log.write(format("{\"step\":%d,\"sample\":%s}", step, json_ids(ids).c_str()));
}

struct StepStats {
    double loss = 0, norm = 0, seconds = 0;  // seconds: from train_step's t0 to the losses' arrival (end)
    std::chrono::steady_clock::time_point end;
    std::string skipped;  // why the step guard skipped the update; empty when it was applied
};

// One optimizer step: grad_accum micro-batches forward and backward, then norm, clip and AdamW. The only
// wait is the copy back of the losses and the norm; the step guard (GPT2::update) may skip the update.
// The step's time runs from t0: the end of the step before, where nothing ran between them (main's loop).
inline StepStats train_step(GPT2& model, GpuDataLoader& train, const Options& o, int grad_accum, int step, float lr,
                            float loss_limit, LoopBuffers& buf, std::chrono::steady_clock::time_point t0) {
    const float dloss = 1.0f / (float(o.B) * float(o.T) * float(grad_accum));
    model.zero_grad();
    for (int micro = 0; micro < grad_accum; micro++) {
        DeviceBatch batch = train.next_batch();
        model.forward(batch.inputs, batch.targets, o.B, o.T, buf.step_stats.get() + 1 + micro, dloss);
        if (micro == 0 && step + 1 == o.nan_at_step) {
            cudaCheck(cudaMemsetAsync(buf.step_stats.get() + 1, 0xff, sizeof(float), model.stream()));  // a NaN
        }
        model.backward(batch.inputs, o.B, o.T, micro + 1 == grad_accum);
    }
    // The logged loss is the mean over ranks (update() waits for it with the gradients).
    if (MultiGpu* mg = model.multi()) mg->all_reduce_mean_async(buf.step_stats.get() + 1, size_t(grad_accum), model.stream());
    AdamWSettings settings;
    settings.learning_rate = lr;
    settings.beta1 = o.beta1;
    settings.beta2 = o.beta2;
    settings.eps = o.eps;
    settings.weight_decay = o.weight_decay;
    float* stats = buf.step_stats.get();
    model.update(settings, o.grad_clip, step + 1, uint64_t(rounding_seed(o)), stats, stats + 1, grad_accum, loss_limit);
    cudaCheck(cudaMemcpyAsync(stats + 1 + grad_accum, model.grad_scale(), sizeof(float), cudaMemcpyDeviceToDevice,
                              model.stream()));
    cudaCheck(cudaMemcpyAsync(buf.step_stats_host.get(), stats, size_t(2 + grad_accum) * sizeof(float),
                              cudaMemcpyDeviceToHost, model.stream()));
    cudaCheck(cudaEventRecord(buf.step_done, model.stream()));
    cudaCheck(cudaEventSynchronize(buf.step_done));
    const float* h = reinterpret_cast<const float*>(buf.step_stats_host.get());
    StepStats s;
    s.norm = h[0];
    bool finite_losses = true;
    for (int micro = 0; micro < grad_accum; micro++) {
        s.loss += double(h[1 + micro]);
        finite_losses = finite_losses && std::isfinite(h[1 + micro]);
    }
    s.loss /= grad_accum;
    if (std::isnan(h[1 + grad_accum])) s.skipped = skip_reason(s.norm, finite_losses, s.loss, double(loss_limit));
    s.end = std::chrono::steady_clock::now();
    s.seconds = std::chrono::duration<double>(s.end - t0).count();
    return s;
}

// Throughput bookkeeping; the first step (warm-up) is left out of the averages when there are others.
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

// After the first step, what the cuBLASLt tuning chose (it tunes each matmul shape at its first call).
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
        std::printf("step %5d/%d | loss %.6f | lr %.2e | norm %.4f | %.2f ms | %.0f tok/s | MFU %s | ETA %s%s\n",
                    step + 1, max_steps, s.loss, double(lr), s.norm, s.seconds * 1e3, tok_per_s,
                    tp.mfu_text(tok_per_s, "%.1f%%").c_str(),
                    duration_text(tp.seconds_per_step(s.seconds) * (max_steps - step - 1)).c_str(),
                    s.skipped.empty() ? "" : format(" | update skipped: %s", s.skipped.c_str()).c_str());
        std::fflush(stdout);
    }
    out.log.write(format("{\"step\":%d,\"loss\":%s,\"lr\":%s,\"norm\":%s,\"ms\":%.3f,\"tok_per_s\":%.1f,\"mfu\":%s}",
                         step + 1, json_number(s.loss, "%.17g").c_str(), json_number(lr, "%.6g").c_str(),
                         json_number(s.norm, "%.9g").c_str(), s.seconds * 1e3, tok_per_s,
                         m >= 0 ? format("%.4f", m).c_str() : "null"));
    if (!s.skipped.empty()) out.log.write(skipped_record(step + 1, s.skipped));
}

// ----------------------------------------------------------------------------------------------------
// Stopping early (llmc/run_control.h decides; the ranks agree here).

inline RunControl::Limits run_limits(const Options& o, const Plan& plan, int64_t num_params) {
    RunControl::Limits l;
    l.max_bad_steps = o.max_bad_steps;
    l.loss_spike = o.loss_spike;
    l.time_limit_s = plan.time_limit_s;
    l.time_limit_text = o.time_limit;
    l.checkpoint_seconds = double(num_params) * 14.0 / 0.5e9;  // 14 bytes per parameter at 0.5 GB/s, until measured
    return l;
}

// Every rank checks (the parameters are the same everywhere), so that all of them stop together.
inline void require_finite_parameters(GPT2& model, int step, const char* what) {
    if (!model.parameters_finite()) {
        fail(kExitDiverged, "step %d: the parameters are not finite; %s not written (the newest checkpoint on disk "
             "holds the last good state)", step, what);
    }
}

// ----------------------------------------------------------------------------------------------------
// Checkpoints and resume.

inline CheckpointManifest checkpoint_meta(const std::vector<RunSetting>& settings, const GPT2& model, const Plan& plan,
                                          const Data& data, const RunControl& control, int step) {
    CheckpointManifest m;
    m.settings = recorded_settings(settings);
    m.settings.push_back({"ranks", format("%d", plan.parallel.ranks.world)});
    for (auto& kv : checkpoint_layout_settings(model)) m.settings.push_back(std::move(kv));
    // The schedule position is the step; the rate is recorded for the reader's benefit.
    m.settings.push_back({"lr_at_step", format("%.9g", plan.schedule.at(step))});
    m.blobs.push_back({"train_loader", data.train->state()});
    if (data.val) m.blobs.push_back({"val_loader", data.val->state()});
    m.blobs.push_back({"step_guard", control.state()});
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

// The checkpointer, when this rank writes checkpoints (every rank its shard with ZeRO-1, else rank 0).
// `async` false: a synchronous one, for a run without -n that must save before it stops.
inline std::unique_ptr<Checkpointer> make_checkpointer(const Options& o, GPT2& model, MultiGpu* multi, bool async) {
    std::unique_ptr<Checkpointer> ckpt;
    if (model.sharded() && multi->world() > 1) {
        ckpt = std::make_unique<Checkpointer>(checkpoint_tensors(model), async, multi->rank(), multi->world(),
                                              [multi](bool failed) { return multi->any(failed); }, o.nccl_timeout);
    } else if (multi == nullptr || multi->is_root()) {
        ckpt = std::make_unique<Checkpointer>(checkpoint_tensors(model), async);
    }
    if (ckpt && ckpt->async()) {
        std::printf("checkpoint snapshot buffers: %s of device memory\n",
                    human_bytes(double(ckpt->snapshot_device_bytes())).c_str());
    }
    return ckpt;
}

// Restores the newest checkpoint in the output directory that loads cleanly and returns its step (0 if
// none). A checkpoint any rank cannot load is skipped with the reason printed; a configuration or data
// that differs from the checkpoint's is an error. The step guard's bookkeeping goes into `control`.
inline int resume_from_checkpoint(const std::vector<CheckpointEntry>& candidates, const Options& o, const Plan& plan,
                                  GPT2& model, Data& data, Outputs& out, RunControl& control) {
    if (candidates.empty()) {
        std::printf("resume: no checkpoint in '%s'; starting from step 0\n", o.output_dir.c_str());
        return 0;
    }
    const std::vector<RunSetting> settings = run_settings(o, plan);
    const int world = plan.parallel.ranks.world;
    DeviceFileIO io;
    size_t skipped = 0;
    for (const CheckpointEntry& c : candidates) {
        // Why this rank cannot use the checkpoint ("" when it can); only files that are bad count.
        std::string bad;
        auto check = [&](auto&& fn) {
            if (!bad.empty()) return;
            try {
                fn();
            } catch (const Error& e) {
                if (e.exit_code() != kExitData && e.exit_code() != kExitIo) throw;
                bad = e.what();
            }
        };
        CheckpointManifest m;
        check([&] {
            m = validate_checkpoint(c.path, /*deep=*/false);
            if (!m.blob("train_loader")) fail(kExitData, "'%s' has no DataLoader state", c.path.c_str());
        });
        std::vector<std::string> notes;
        int saved_world = 0;
        std::string resharded;
        RunControl guard = control;  // takes up the checkpoint's step guard state, kept if this checkpoint is used
        bool guard_saved = false;
        if (bad.empty()) {
            const std::string diff = settings_differences(m, recorded_settings(settings), must_match_keys(settings), &notes);
            if (!diff.empty()) {
                fail(kExitUsage, "cannot resume from '%s': this run's configuration differs from the checkpoint's: %s",
                     c.path.c_str(), diff.c_str());
            }
            if (m.step > plan.max_steps) {
                fail(kExitUsage, "cannot resume from '%s' at step %lld: -x/--max-steps is %d", c.path.c_str(),
                     (long long)m.step, plan.max_steps);
            }
            // Another number of ranks continues the same sample stream and re-shards the optimizer state.
            try {
                saved_world = int(SampleSchedule::state_world(*m.blob("train_loader")));
                data.train->restore(*m.blob("train_loader"), /*allow_world_change=*/true);
            } catch (const Error& e) {
                fail(kExitUsage, "cannot resume from '%s': %s", c.path.c_str(), e.what());
            }
            check([&] { resharded = load_checkpoint(model, c.path, m, io); });
            check([&] {
                if (const std::vector<uint8_t>* g = m.blob("step_guard")) {
                    guard.restore(*g, c.path);
                    guard_saved = true;
                }
            });
        }
        if (!bad.empty() && model.multi() != nullptr && !model.multi()->is_root()) {
            std::fprintf(stderr, "rank %d: cannot resume from %s: %s\n", model.multi()->rank(), c.path.c_str(), bad.c_str());
        }
        if (model.multi() ? model.multi()->any(!bad.empty(), model.stream()) : !bad.empty()) {
            std::printf("resume: skipping %s: %s\n", c.path.c_str(),
                        bad.empty() ? "another rank cannot load it (its reason is on that rank's stderr)" : bad.c_str());
            skipped++;
            continue;
        }
        for (const std::string& n : notes) std::printf("resume: changed setting %s\n", n.c_str());
        if (saved_world != world) {
            std::printf("resume: the checkpoint was written by %d rank(s), this run has %d: the DataLoader continues "
                        "the same sample stream\n", saved_world, world);
        }
        if (!resharded.empty()) std::printf("resume: %s\n", resharded.c_str());
        const std::string fp8_note = removed_fp8_note(m);
        if (!fp8_note.empty()) std::printf("resume: %s\n", fp8_note.c_str());
        control = guard;
        if (!guard_saved) {
            std::printf("resume: the checkpoint holds no step guard state (written by an older version): the "
                        "--loss-spike mean and the count of skipped steps start afresh\n");
        }
        std::printf("resume: restored %s%s: step %lld (next step %lld), master weights, bf16 parameters, AdamW m and "
                    "v, DataLoader at batch %llu (epoch %llu), LR schedule at step %lld, seeds (init %lld, rounding "
                    "%lld, sampling %lld), step guard\n",
                    c.path.c_str(), skipped ? format(" (after skipping %zu newer)", skipped).c_str() : "",
                    (long long)m.step, (long long)m.step + 1, (unsigned long long)data.train->position(),
                    (unsigned long long)data.train->epoch(), (long long)m.step, (long long)o.seed,
                    (long long)rounding_seed(o), (long long)o.sample_seed);
        std::fflush(stdout);
        out.log.write(format("{\"resume_from_step\":%lld}", (long long)m.step));
        return int(m.step);
    }
    fail(kExitData, "-y 1: none of the %zu checkpoint(s) in '%s' is valid (reasons above); remove them to start over",
         candidates.size(), o.output_dir.c_str());
}

// The trained model in every format --save-model names (with ZeRO-1 every rank takes part in the gather).
inline void save_trained_models(GPT2& model, const Options& o, const Plan& plan, bool root, JsonlLog& log) {
    if (o.output_dir.empty() || plan.save_formats.empty()) return;
    require_finite_parameters(model, plan.max_steps, "the trained model");
    SaveOptions save;
    if (std::any_of(plan.save_formats.begin(), plan.save_formats.end(), is_hf_format)) {
        std::string note;
        save.tokenizer_dir = tokenizer_for_export(o.vocab_dir, plan.config.vocab_size, &note);
        if (!note.empty() && root) std::printf("note: %s\n", note.c_str());
    }
    std::vector<std::string> paths;
    for (ModelFormat f : plan.save_formats) paths.push_back(saved_model_path(o.output_dir, f));
    save_run_outputs(log, plan.max_steps, paths, [&](size_t i) {
        const ModelFormat f = plan.save_formats[i];
        if (f == ModelFormat::Llmc) {
            DeviceFileIO io;
            if (root || model.sharded()) write_trained_model(model, paths[i], io, root);
        } else {
            export_trained_model(model, paths[i], f, save, root);
        }
        std::printf("wrote %s (%s)\n", paths[i].c_str(), model_format_name(f));
    });
}

// Several ranks: each prints a checksum of its bf16 parameters, so drifted replicas show.
inline void print_parameter_checksum(GPT2& model) {
    if (model.multi() == nullptr) return;
    std::vector<floatX> host(size_t(model.num_parameters()));
    cudaCheck(cudaMemcpyAsync(host.data(), model.params(), host.size() * sizeof(floatX), cudaMemcpyDeviceToHost,
                              model.stream()));
    cudaCheck(cudaStreamSynchronize(model.stream()));
    std::fprintf(stderr, "rank %d parameter checksum %016llx\n", model.multi()->rank(),
                 (unsigned long long)checksum64(host.data(), host.size() * sizeof(floatX)));
}

inline void print_summary(const Throughput& tp, const Plan& plan, double first_val, double last_val) {
    if (tp.timed_steps > 0) {
        const double tok_per_s = double(tp.tokens_per_step) * tp.timed_steps / tp.timed_seconds;
        std::printf("average over %d steps: %.2f ms/step, %.0f tok/s, MFU %s\n", tp.timed_steps,
                    1e3 * tp.timed_seconds / tp.timed_steps, tok_per_s, tp.mfu_text(tok_per_s, "%.1f%%").c_str());
    }
    if (plan.validate()) std::printf("val loss: %.6f -> %.6f\n", first_val, last_val);
    size_t free_bytes = 0, total_bytes = 0;
    cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
    std::printf("peak GPU memory: %s (all allocated at start; CUDA context included)\n",
                human_bytes(double(total_bytes - free_bytes)).c_str());
}

}  // namespace llmc

// ----------------------------------------------------------------------------------------------------

using namespace llmc;

int main(int argc, char** argv) {
    const auto started = std::chrono::steady_clock::now();
    return run_main([&]() -> int {
        // Flags, the model's shape, the ranks and the data, checked before anything touches CUDA.
        Options opt;
        Flags flags = trainer_flags(opt);
        if (!flags.parse(argc, argv)) return kExitOk;
        // A run that trains nothing writes a model only when asked (must not replace an earlier one).
        if (opt.max_steps == 0 && !flags.was_set("save-model")) opt.save_model = "none";
        check_output_flags(flags, opt.output_dir, opt.save_model, !parse_save_formats(opt.save_model).empty());
        const ModelSource source = resolve_model(opt.model);
        const Plan plan = plan_run(opt, source.config, resolve_ranks(opt));
        const std::vector<RunSetting> settings = run_settings(opt, plan);
        // A fresh run must not start among an earlier run's checkpoints (log.jsonl, a later -y 1).
        if (opt.resume == 0 && opt.max_steps != 0 && !opt.output_dir.empty()) {
            const std::vector<CheckpointEntry> earlier = list_checkpoints(opt.output_dir);
            if (!earlier.empty()) {
                fail(kExitUsage, "-o %s holds %zu checkpoint(s) of an earlier run (the newest: %s): resume it with -y 1, "
                     "or start over in another directory or after removing them", opt.output_dir.c_str(),
                     earlier.size(), earlier.front().path.c_str());
            }
        }
        if (opt.dry_run) {
            print_plan(flags, opt, plan, source);
            return kExitOk;
        }
        check_host_memory(opt, plan);
        const std::vector<CheckpointEntry> candidates =
            opt.resume == 1 ? list_checkpoints(opt.output_dir) : std::vector<CheckpointEntry>();
        install_stop_signals();
        if (plan.parallel.ranks.rank == 0 && !opt.output_dir.empty()) {
            require_writable_directory(opt.output_dir, "-o/--output-dir");
        }

        // Several GPUs: meet the other ranks (this picks the GPU); rank 0 alone prints and writes files.
        std::unique_ptr<MultiGpu> multi = meet_ranks(opt, plan);
        // Start-up (allocation, the data's upload, a checkpoint's load) may take long on a big model.
        if (multi) multi->heartbeat("starting", 3600);
        const bool root = plan.parallel.ranks.rank == 0;
        if (!root && std::freopen("/dev/null", "w", stdout) == nullptr) {
            fail(kExitIo, "rank %d: cannot silence stdout: %s", plan.parallel.ranks.rank, std::strerror(errno));
        }
        const Device device = open_device(multi ? multi->device() : 0);
        print_plan(flags, opt, plan, source);

        // The model and the data, from the start or from a checkpoint.
        Stream stream;
        GPT2 model(source.config, opt.B, opt.T, stream, multi.get(), plan.parallel.zero_stage, opt.recompute == 1);
        // Decided, not flags: cuBLASLt algorithm tuning, backward's second stream, the classifier's exp path.
        model.set_gemm_tuning(true);
        model.set_dw_stream(2);
        model.set_classifier_exp(true);
        if (candidates.empty()) model.set_parameters(initial_parameters(source, uint64_t(opt.seed)));
        Data data(opt, plan, stream);
        print_device(device, model, data);
        if (multi) multi->check_same(uint64_t(candidates.size()), "the number of checkpoints found to resume from");
        // Made after the model, so that it is destroyed first: no save is in flight when the model goes away.
        std::unique_ptr<Checkpointer> ckpt =
            opt.checkpoint_every > 0 ? make_checkpointer(opt, model, multi.get(), /*async=*/true) : nullptr;
        LoopBuffers buf(plan, opt.T);
        std::unique_ptr<McEvalGpu> mc = plan.evaluate_mc() ? std::make_unique<McEvalGpu>(model) : nullptr;
        if (mc) mc->reserve(plan.eval);  // allocated now, not at the first evaluation
        // Everything is allocated: only now may an earlier run's log.jsonl be replaced (a resume appends).
        Outputs out(opt, root, /*append_log=*/!candidates.empty());
        // Stopping early: the step guard (restored with the rest on resume), signals and --time-limit.
        RunControl control(run_limits(opt, plan, model.num_parameters()), started);
        const int start_step =
            opt.resume == 1 ? resume_from_checkpoint(candidates, opt, plan, model, data, out, control) : 0;
        // Every rank must have resumed from the same checkpoint (each validated it on its own).
        if (multi && opt.resume == 1) multi->check_same(uint64_t(start_step), "the step resumed from");
        Throughput tp{flops_per_token(plan.config, opt.T), device.peak_flops * plan.parallel.ranks.world,
                      plan.tokens_per_step};
        CheckpointReport report;
        // On an error from here on, abort NCCL before anything waits on it, so the other ranks stop too.
        const MultiGpuAbortOnError abort_on_error(multi.get());
        auto report_saves = [&] {
            if (ckpt && ckpt->poll(&report)) {
                print_checkpoint_report(report, ckpt->async());
                control.saved(report.write_seconds);
            }
        };

        // The loop: evaluate and sample between steps (and after the last), train in between. A step's time
        // runs from the end of the step before, so that it counts the host's work between steps and whatever
        // the GPU still does for the step before (AdamW beside the forward); after an evaluation, a sample or
        // a checkpoint, which are not counted, from the step's own start.
        double first_val = NAN, last_val = NAN;
        std::optional<std::chrono::steady_clock::time_point> step_clock;
        for (int step = start_step; step <= plan.max_steps; step++) {
            const bool last = step == plan.max_steps;
            if (data.val && (step % opt.val_every == 0 || last)) {
                step_clock.reset();
                if (multi) multi->heartbeat("evaluating");
                last_val = evaluate(model, *data.val, plan.val_steps, opt.B, opt.T, buf);
                if (std::isnan(first_val)) first_val = last_val;
                std::printf("step %5d/%d | val loss %.6f\n", step, plan.max_steps, last_val);
                out.log.write(format("{\"step\":%d,\"val_loss\":%s}", step, json_number(last_val, "%.9g").c_str()));
            }
            if (mc && ((opt.eval_every > 0 && step % opt.eval_every == 0) || last)) {
                step_clock.reset();
                if (multi) multi->heartbeat("evaluating multiple choice");
                evaluate_choices(*mc, plan.eval, step, plan.max_steps, out.log);
            }
            if (opt.sample_every > 0 && plan.gen_tokens > 0 && ((step > 0 && step % opt.sample_every == 0) || last)) {
                step_clock.reset();
                if (multi) multi->heartbeat("sampling (rank 0 alone)", 600);  // the others wait in a collective
                if (root) print_sample(model, opt, plan, out, buf, step);
            }
            if (last) break;
            const float lr = float(plan.schedule.at(step));
            if (multi) multi->heartbeat("training");
            const StepStats s = train_step(model, *data.train, opt, plan.grad_accum, step, lr, control.loss_limit(), buf,
                                           step_clock.value_or(std::chrono::steady_clock::now()));
            step_clock = s.end;
            tp.add(step, plan.max_steps, s.seconds);
            if (root && step == start_step) print_gemm_tuning(model.cublas());
            log_step(out, tp, step, plan.max_steps, lr, s,
                     (step + 1) % opt.log_every == 0 || step + 1 == plan.max_steps || !s.skipped.empty());
            control.after_step(step + 1, s.loss, s.skipped);
            const std::string why = control.reason(tp.seconds_per_step(s.seconds));
            // Every rank stops after the same step, so that the checkpoint is whole.
            const bool stop = multi ? multi->any(!why.empty(), stream) : !why.empty();
            report_saves();
            const bool due = opt.checkpoint_every > 0 &&
                             ((step + 1) % opt.checkpoint_every == 0 || step + 1 == plan.max_steps);
            if (stop && !ckpt && opt.checkpoint_every == 0 && !opt.output_dir.empty()) {
                ckpt = make_checkpointer(opt, model, multi.get(), /*async=*/false);
            }
            if (due || (stop && !opt.output_dir.empty())) {
                step_clock.reset();
                if (multi) multi->heartbeat("saving a checkpoint", 3600);
                require_finite_parameters(model, step + 1, "the checkpoint");
                if (ckpt) {
                    ckpt->save(opt.output_dir, step + 1, checkpoint_tensors(model),
                               checkpoint_meta(settings, model, plan, data, control, step + 1), stream, opt.keep_last,
                               opt.keep_every);
                }
                report_saves();
            }
            if (stop) {
                if (ckpt) ckpt->wait();
                report_saves();
                std::printf("stopped after step %d: %s; %s\n", step + 1, why.empty() ? "another rank asked to" : why.c_str(),
                            opt.output_dir.empty() ? "no output directory, nothing saved"
                                                   : format("resume with -y 1 -o %s", opt.output_dir.c_str()).c_str());
                std::fflush(stdout);
                out.log.write(format("{\"step\":%d,\"stopped\":\"%s\"}", step + 1, why.c_str()));
                if (multi) multi->barrier();
                return int(kExitStopped);
            }
        }
        if (ckpt) {
            if (multi) multi->heartbeat("finishing the last checkpoint", 3600);
            ckpt->wait();
            report_saves();
        }

        // The summary and the trained model.
        print_summary(tp, plan, first_val, last_val);
        if (multi) multi->heartbeat("writing the model", 3600);
        save_trained_models(model, opt, plan, root, out.log);
        print_parameter_checksum(model);
        if (multi) multi->barrier();  // no rank tears NCCL down while another still needs it
        return int(kExitOk);
    });
}
