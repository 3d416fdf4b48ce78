/*
train_gpt2: GPT-2 training on the CPU with the fp32 reference model (cpu/gpt2_cpu.h), the quick start
for a machine without a GPU and a way to train tiny models.

It speaks the GPU trainer's language: the same flags with the same letters and meanings, from one table
(llmc/trainer_flags.h: -i -j -e -o -b -t -d -l -u -q -k -c -x -v -m -s -g and the long-only ones; --help
lists them with their ranges), the same DataLoader (llmc/dataloader.h: comma-separated globs, training
samples shuffled by --seed, so the same flags give the same batches as train_gpt2cu), the same
learning-rate schedules (llmc/schedule.h), the same initialisation for a seed, the same sampler
(llmc/sampler.h) and the same log.jsonl lines ({"step":S,"loss":..,"lr":..,"norm":..,"ms":..,
"tok_per_s":..}, {"step":S,"val_loss":..} and {"step":S,"sample":[ids]}), so one script plots or compares
the runs of both. Besides the GPU trainer's descriptors (d2 ... d48) and model files, a model can have an
explicit shape (--layers, --channels, --heads, --vocab, --max-seq-len), for tiny models on tiny
vocabularies.

A run: check the flags; create the output directory and prove it writable (a missing one is created; an
unwritable one fails at once, before any work); learn the model's shape; check that the run fits in host
memory (a run too big is refused with both figures, llmc/run_settings.h); open the data; build or load
the model with all the memory its training takes; start log.jsonl (so that a refused command line or a
shortage of memory leaves an earlier run's log as it was); then loop {evaluate, sample, train one step}
and write the model. The step guard is the GPU trainer's: a step whose loss or gradient norm is not
finite leaves the model as it was and is logged as skipped, --max-bad-steps of them in a row end the run
with exit code 6 (llmc/run_control.h), and no model file is written from parameters that are not finite.
-x 0 trains nothing: it evaluates and samples a model, e.g.
`./train_gpt2 -e model.bin -x 0 -g 20 --temperature 0 --prompt-ids 464,3290`.

Numbers do not depend on OMP_NUM_THREADS (gpt2_cpu.h reduces in a fixed order).

Does not provide: checkpoints with optimizer state or resume, several processes, a KV cache for sampling
(each token reruns the forward over the tokens so far), or a GPU; the GPU trainer (train_gpt2.cu) has
those.
*/
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <omp.h>

#include "cpu/gpt2_cpu.h"
#include "cpu/mc_eval_cpu.h"
#include "llmc/dataloader.h"
#include "llmc/gpt2_config.h"
#include "llmc/mc_eval.h"
#include "llmc/model_file.h"
#include "llmc/model_io.h"
#include "llmc/prompt.h"
#include "llmc/run_control.h"
#include "llmc/run_log.h"
#include "llmc/run_settings.h"
#include "llmc/sampler.h"
#include "llmc/schedule.h"
#include "llmc/tokenizer.h"
#include "llmc/trainer_flags.h"
#include "llmc/utils.h"

using namespace llmc;

namespace {

// ----------------------------------------------------------------------------------------------------
// The command line: the trainers' one flag table (llmc/trainer_flags.h). Defaults follow train_gpt2cu
// except where a CPU wants smaller numbers: the model (d2), the batch (4 x 64), the steps (50), the
// learning rate and weight decay for tiny models, and no sample unless -g asks for one (each sampled
// token reruns the whole forward).

using Options = TrainerOptions<Trainer::Cpu>;

// What the flag table's ranges cannot say, checked before any work.
void check_options(const Flags& flags, const Options& o) {
    const int shape = (o.layers > 0) + (o.channels > 0) + (o.heads > 0);
    if (shape != 0 && shape != 3) fail(kExitUsage, "an explicit shape needs all of --layers, --channels and --heads");
    if (shape == 3 && flags.was_set("model")) {
        fail(kExitUsage, "give either -e/--model or an explicit shape (--layers, --channels, --heads), not both");
    }
    if (shape == 0 && (flags.was_set("vocab") || flags.was_set("max-seq-len"))) {
        fail(kExitUsage, "--vocab and --max-seq-len belong to an explicit shape (--layers, --channels, --heads)");
    }
    if (o.val_max_steps == 0) fail(kExitUsage, "-m/--val-max-steps 0: must be -1 (all) or at least 1");
    if (o.eval_max_items == 0) fail(kExitUsage, "--eval-max-items 0: must be -1 (all) or at least 1");
    if (o.total_batch == 0) fail(kExitUsage, "-d/--total-batch 0: must be -1 (B*T) or positive");
    if (o.train_pattern.empty() && o.max_steps != 0) fail(kExitUsage, "-i/--train: no training shards named");
    check_output_flags(flags, o.output_dir, o.save_model, !parse_save_formats(o.save_model).empty());
    LRSchedule::parse_kind(o.schedule);
}

// ----------------------------------------------------------------------------------------------------
// The output directory and log.jsonl.

// log.jsonl in the output directory (llmc/run_log.h), and the tokenizer that turns samples into text.
struct Outputs {
    std::string dir;
    JsonlLog log;
    Tokenizer tokenizer;
    bool have_tokenizer = false;

    // Checks the directory now; log.jsonl is started by open_log() once the run is known to start (the
    // command line checked, the model built and its memory allocated).
    explicit Outputs(const std::string& output_dir) : dir(output_dir) {
        if (!dir.empty()) require_writable_directory(dir, "-o/--output-dir");
    }
    // Starts log.jsonl (replacing an earlier run's) only once nothing can refuse the run any more; with
    // no_training (-x 0) an earlier log is appended to instead (open_run_log). model: what -e named.
    void open_log(bool no_training, const std::string& model) {
        if (!dir.empty()) log = open_run_log(dir + "/log.jsonl", /*resume=*/false, no_training, model);
    }
    void write(const std::string& line) { log.write(line); }
    void load_tokenizer(const std::string& path) {
        if (regular_file_exists(path)) {
            tokenizer = read_tokenizer_bin(path);
            have_tokenizer = true;
        } else {
            std::printf("note: tokenizer '%s' not found; samples are printed as token ids\n", path.c_str());
        }
    }
    const Tokenizer* tokenizer_or_null() const { return have_tokenizer ? &tokenizer : nullptr; }
    std::string text(const std::vector<uint32_t>& ids) const { return sample_text(tokenizer_or_null(), ids); }
};

// ----------------------------------------------------------------------------------------------------
// The model.

// Where the model comes from: a -e path (an llm.c model file or a Hugging Face folder, llmc/model_io.h),
// probed now and its weights read once the run is known to fit in memory, or a new model.
struct ModelSource {
    GPT2Config config;
    ModelInfo info;      // info.path is empty for a new model
    std::string origin;  // for the start-up line
};

ModelSource resolve_model(const Options& o) {
    ModelSource m;
    if (o.layers == 0 && model_path_exists(o.model)) {
        m.info = probe_model(o.model);
        m.config = m.info.config;
        m.origin = m.info.describe();
    } else if (o.layers > 0) {
        m.config = make_config(o.layers, o.channels, o.heads, o.vocab, o.max_seq_len);
        m.origin = format("new, explicit shape (seed %lld)", (long long)o.seed);
    } else if (o.model.size() >= 2 && o.model[0] == 'd' && o.model.find_first_not_of("0123456789", 1) == std::string::npos) {
        m.config = config_from_descriptor(o.model);
        m.origin = format("new %s (seed %lld)", o.model.c_str(), (long long)o.seed);
    } else if (o.model.find('/') != std::string::npos || o.model.find('.') != std::string::npos) {
        fail(kExitIo, "-e/--model '%s': %s", o.model.c_str(), why_not_regular_file(o.model).c_str());
    } else {
        fail(kExitUsage, "-e/--model '%s' is neither a model file nor a descriptor (d2, d6, d12, d24, d36, d48)",
             o.model.c_str());
    }
    return m;
}

// The parameters: the -e model's weights, or a new model's initialisation from --seed.
void load_parameters(cpu::GPT2<float>& model, const ModelSource& src, uint64_t seed) {
    if (src.info.path.empty()) {
        init_parameters(src.config, seed, model.params.data());
    } else {
        model.params = load_model_params(src.info.path, src.info);
    }
}

// ----------------------------------------------------------------------------------------------------
// The plan: the settings checked against the model, and the data.

struct Plan {
    int grad_accum = 1;
    int64_t tokens_per_step = 0;
    LRSchedule schedule;
    std::vector<int> prompt;
    int gen_tokens = 0;  // 0: no samples
    std::vector<ModelFormat> save;
    McSet eval;  // --eval's items (none: no evaluation)
};

Plan plan_run(const Flags& flags, const Options& o, const GPT2Config& c) {
    if (o.T > c.max_seq_len) {
        fail(kExitUsage, "-t/--seq-len %d is longer than the model's maximum sequence length %d", o.T, c.max_seq_len);
    }
    Plan p;
    p.tokens_per_step = o.total_batch == -1 ? int64_t(o.B) * o.T : o.total_batch;
    p.grad_accum = micro_steps_per_step(p.tokens_per_step, o.B, o.T, 1);
    p.schedule.kind = LRSchedule::parse_kind(o.schedule);
    p.schedule.lr = o.lr;
    p.schedule.warmup = o.warmup;
    p.schedule.final_fraction = o.final_lr_fraction;
    p.schedule.decay_fraction = o.decay_fraction;
    for (uint32_t id : prompt_tokens(o.prompt, o.prompt_ids, o.vocab_dir, c.vocab_size)) p.prompt.push_back(int(id));
    if (int(p.prompt.size()) >= c.max_seq_len) {
        fail(kExitUsage, "--prompt/--prompt-ids: %zu tokens leave no room to generate within the model's maximum sequence "
             "length %d", p.prompt.size(), c.max_seq_len);
    }
    if (o.sample_every > 0 && o.gen_tokens > 0) {
        const int room = c.max_seq_len - std::max<int>(1, int(p.prompt.size()));
        p.gen_tokens = std::min(o.gen_tokens, room);
        if (p.gen_tokens < o.gen_tokens) {
            std::printf("note: -g/--gen-tokens %d: the model's maximum sequence length %d leaves room for %d after the "
                        "prompt\n", o.gen_tokens, c.max_seq_len, p.gen_tokens);
        }
    }
    p.save = parse_save_formats(o.save_model);
    if (o.output_dir.empty() || (o.max_steps == 0 && !flags.was_set("save-model"))) p.save.clear();
    if (!o.eval_file.empty()) {
        p.eval = read_mc_file(o.eval_file, c.vocab_size);
        if (o.eval_max_items >= 0 && size_t(o.eval_max_items) < p.eval.items.size()) {
            p.eval.items.resize(size_t(o.eval_max_items));
        }
        if (p.eval.items.empty()) fail(kExitData, "--eval '%s' holds no items", o.eval_file.c_str());
        mc_check_items(p.eval, c.vocab_size, o.T);
    }
    return p;
}

// Refuses a run that would not fit in host memory (llmc/run_settings.h), before the model is built or the
// data opened: the parameters and their gradients, AdamW's m and v when it trains, a copy of the
// parameters (a model file read or written), the activations of the (B, T) batches and of a sample's
// longest forward, and the data loaders' buffers.
void check_host_memory(const Options& o, const Plan& plan, const GPT2Config& c) {
    const bool trains = o.max_steps != 0;
    const bool batches = trains || (!o.val_pattern.empty() && o.val_every > 0) || !plan.eval.items.empty();
    const double model = double(num_parameters(c)) * sizeof(float) * (trains ? 5 : 3);
    const int sample_T = std::max<int>(1, int(plan.prompt.size())) + plan.gen_tokens;
    const double acts = (batches ? cpu::GPT2<float>::activation_bytes(c, o.B, o.T) : 0) +
                        (plan.gen_tokens > 0 ? cpu::GPT2<float>::activation_bytes(c, 1, sample_T) : 0);
    const double loaders = 6.0 * o.B * (o.T + 1) * sizeof(int32_t);
    require_host_memory(model + acts + loaders,
                        format("the model%s %s, activations for -b %d -t %d %s", trains ? " and AdamW's state" : "",
                               human_bytes(model).c_str(), o.B, o.T, human_bytes(acts).c_str()),
                        "lower -b or -t");
}

DataLoaderConfig loader_config(const std::string& pattern, const Options& o, const GPT2Config& c, bool shuffle) {
    DataLoaderConfig d;
    d.pattern = pattern;
    d.B = o.B;
    d.T = o.T;
    d.vocab_size = uint32_t(c.vocab_size);
    d.shuffle = shuffle;
    d.seed = uint64_t(o.seed);
    d.prefetch = 2;
    return d;
}

// The training and validation loaders, and the step counts that follow from the data.
struct Data {
    std::unique_ptr<DataLoader> train, val;
    int max_steps = 0;
    int val_steps = 0;

    Data(const Options& o, const GPT2Config& c, Plan& plan) {
        if (o.max_steps != 0) {
            train = std::make_unique<DataLoader>(loader_config(o.train_pattern, o, c, o.shuffle));
            const uint64_t epoch = std::max<uint64_t>(1, train->schedule().batches_per_epoch() / uint64_t(plan.grad_accum));
            max_steps = o.max_steps >= 0 ? o.max_steps : int(std::min<uint64_t>(epoch, INT32_MAX));
        }
        plan.schedule.total = std::max(1, max_steps);
        if (!o.val_pattern.empty() && o.val_every > 0) {
            val = std::make_unique<DataLoader>(loader_config(o.val_pattern, o, c, false));
            const uint64_t all = std::max<uint64_t>(1, val->schedule().batches_per_epoch());
            val_steps = int(o.val_max_steps == -1 ? std::min<uint64_t>(all, INT32_MAX)
                                                  : std::min<uint64_t>(all, uint64_t(o.val_max_steps)));
        }
    }
};

void print_startup(const Flags& flags, const Options& o, const Plan& plan, const ModelSource& start, const Data& data) {
    std::fputs(flags.settings_table().c_str(), stdout);
    std::printf("model: %s, %s, %lld parameters, %.1f MFLOP per token (6N + 6LCT)\n", start.origin.c_str(),
                describe(start.config).c_str(), (long long)num_parameters(start.config),
                flops_per_token(start.config, o.T) / 1e6);
    if (data.train) {
        const uint64_t epoch_batches = std::max<uint64_t>(1, data.train->schedule().batches_per_epoch());
        std::printf("batch %d x %d, %lld tokens per step, %d micro-step(s) per step, %d steps = %.3f epochs of %llu "
                    "tokens; train data: %zu shard(s)\n", o.B, o.T, (long long)plan.tokens_per_step, plan.grad_accum,
                    data.max_steps, double(data.max_steps) * plan.grad_accum / double(epoch_batches),
                    (unsigned long long)data.train->schedule().total_tokens(), data.train->schedule().shards().size());
    } else {
        std::printf("no training (-x 0)\n");
    }
    if (data.val) {
        std::printf("val data: %zu shard(s), %llu tokens; %d batches per evaluation\n",
                    data.val->schedule().shards().size(), (unsigned long long)data.val->schedule().total_tokens(),
                    data.val_steps);
    } else {
        std::printf("val data: none\n");
    }
    if (!plan.prompt.empty()) {
        std::printf("prompt: %zu token(s) %s\n", plan.prompt.size(),
                    json_ids(std::vector<uint32_t>(plan.prompt.begin(), plan.prompt.end())).c_str());
    }
    std::printf("threads: %d\n", omp_get_max_threads());
    std::fflush(stdout);
}

// ----------------------------------------------------------------------------------------------------
// The loop's pieces.

struct Batch {
    std::vector<int32_t> inputs, targets;
    void next(DataLoader& loader) {
        const HostBatch& b = loader.next();
        inputs.resize(size_t(b.B) * b.T);
        targets.resize(inputs.size());
        unpack_batch(b, inputs.data(), targets.data());
    }
};

// The mean validation loss over `steps` batches from the start of the validation set.
double evaluate(cpu::GPT2<float>& model, DataLoader& val, int steps, int B, int T, Batch& batch) {
    val.reset();
    double sum = 0;
    for (int i = 0; i < steps; i++) {
        batch.next(val);
        sum += model.forward(batch.inputs.data(), batch.targets.data(), B, T);
    }
    return sum / steps;
}

struct StepStats {
    double loss = 0, norm = 0, seconds = 0;
    std::string skipped;  // why the step guard skipped the update; empty when it was applied
};

// One optimizer step over grad_accum batches. backward() adds each batch's mean-loss gradient, so the
// sum is divided by grad_accum (in the norm and, with the clip factor, in the update) to give the
// gradient of the mean over all of them. The step guard: when a loss or the norm is not finite, the
// update is skipped (the parameters and AdamW's moments stay as they were) and the stats say why.
StepStats train_step(cpu::GPT2<float>& model, DataLoader& train, const Options& o, int grad_accum, int step, double lr,
                     Batch& batch) {
    const auto t0 = std::chrono::steady_clock::now();
    StepStats s;
    bool finite_losses = true;
    model.zero_grad();
    for (int micro = 0; micro < grad_accum; micro++) {
        batch.next(train);
        double loss = model.forward(batch.inputs.data(), batch.targets.data(), o.B, o.T);
        if (micro == 0 && step + 1 == o.nan_at_step) loss = NAN;
        finite_losses = finite_losses && std::isfinite(loss);
        s.loss += loss;
        model.backward();
    }
    s.loss /= grad_accum;
    s.norm = model.grad_norm() / grad_accum;
    if (finite_losses && std::isfinite(s.norm)) {
        const cpu::AdamW adamw{lr, o.beta1, o.beta2, o.eps, o.weight_decay};
        model.update(adamw, step + 1, cpu::clip_scale(s.norm, o.grad_clip) / grad_accum);
    } else {
        s.skipped = skip_reason(s.norm, finite_losses, s.loss, INFINITY);
    }
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
}

// Seconds per step for the ETA and the summary; the first step (cold caches, allocations) is left out
// when there are others.
struct Throughput {
    double seconds = 0;
    int steps = 0;
    void add(int step, int max_steps, double s) {
        if (step > 0 || max_steps == 1) {
            seconds += s;
            steps++;
        }
    }
    double per_step(double fallback) const { return steps > 0 ? seconds / steps : fallback; }
};

void log_step(Outputs& out, const Throughput& tp, const Plan& plan, int step, int max_steps, double lr,
              const StepStats& s, bool print) {
    const double tok_per_s = double(plan.tokens_per_step) / s.seconds;
    if (print) {
        std::printf("step %5d/%d | loss %.6f | lr %.2e | norm %.4f | %.0f ms | %.0f tok/s | ETA %s%s\n", step + 1, max_steps,
                    s.loss, lr, s.norm, s.seconds * 1e3, tok_per_s,
                    duration_text(tp.per_step(s.seconds) * (max_steps - step - 1)).c_str(),
                    s.skipped.empty() ? "" : format(" | update skipped: %s", s.skipped.c_str()).c_str());
        std::fflush(stdout);
    }
    // 17 digits: the loss reads back as the same double, so logs compare bitwise.
    out.write(format("{\"step\":%d,\"loss\":%s,\"lr\":%s,\"norm\":%s,\"ms\":%.3f,\"tok_per_s\":%.1f}", step + 1,
                     json_number(s.loss, "%.17g").c_str(), json_number(lr, "%.6g").c_str(),
                     json_number(s.norm, "%.9g").c_str(), s.seconds * 1e3, tok_per_s));
    if (!s.skipped.empty()) out.write(skipped_record(step + 1, s.skipped));
}

// n tokens after the prompt (or an end-of-text token), the forward rerun over the tokens so far for each.
std::vector<uint32_t> generate(cpu::GPT2<float>& model, std::vector<int> tokens, int n, float temperature, int top_k,
                               uint64_t seed) {
    const GPT2Config& c = model.config();
    std::vector<uint32_t> out;
    std::vector<float> row(size_t(c.vocab_size));
    SplitMix64 rng(seed);
    for (int i = 0; i < n; i++) {
        const int t = int(tokens.size());
        model.forward(tokens.data(), nullptr, 1, t);
        const float* logits = model.activations().logits.data() + size_t(t - 1) * c.padded_vocab_size;
        std::copy(logits, logits + c.vocab_size, row.begin());
        const uint32_t next = sample_token(row, temperature, top_k, rng);
        tokens.push_back(int(next));
        out.push_back(next);
    }
    return out;
}

void print_sample(cpu::GPT2<float>& model, const Options& o, const Plan& plan, Outputs& out, int step) {
    const std::vector<uint32_t> prompt(plan.prompt.begin(), plan.prompt.end());
    const std::vector<uint32_t> first = sample_start(prompt, out.tokenizer_or_null(), model.config().vocab_size);
    const std::vector<uint32_t> ids = generate(model, std::vector<int>(first.begin(), first.end()), plan.gen_tokens,
                                               o.temperature, o.top_k, uint64_t(o.sample_seed));
    std::printf("---------- sample at step %d ----------\n%s%s\n---------------------------------------\n", step,
                prompt.empty() ? "" : format("%s|", out.text(prompt).c_str()).c_str(), out.text(ids).c_str());
    std::fflush(stdout);
    out.write(format("{\"step\":%d,\"sample\":%s}", step, json_ids(ids).c_str()));
}

// Each format --save-model names, after step `step`, from finite parameters only. llmc/model_io.h writes
// through a temporary name, so an interrupted or failed write never leaves a torn model where a good one
// was (e.g. when -e and the output are the same file); save_run_outputs says in the log which files are
// then not this run's.
void save_models(const cpu::GPT2<float>& model, const Options& o, const Plan& plan, Outputs& out, int step) {
    if (plan.save.empty()) return;
    if (!std::all_of(model.params.begin(), model.params.end(), [](float v) { return std::isfinite(v); })) {
        fail(kExitDiverged, "step %d: the parameters are not finite; the trained model is not written", step);
    }
    SaveOptions save;
    if (std::any_of(plan.save.begin(), plan.save.end(), is_hf_format)) {
        std::string note;
        save.tokenizer_dir = tokenizer_for_export(o.vocab_dir, model.config().vocab_size, &note);
        if (!note.empty()) std::printf("note: %s\n", note.c_str());
    }
    std::vector<std::string> paths;
    for (ModelFormat f : plan.save) paths.push_back(saved_model_path(o.output_dir, f));
    save_run_outputs(out.log, step, paths, [&](size_t i) {
        save_model(paths[i], plan.save[i], model.config(), model.params.data(), save);
        std::printf("wrote %s (%s)\n", paths[i].c_str(), model_format_name(plan.save[i]));
    });
}

// Multiple-choice accuracy with the fp32 model (cpu/mc_eval_cpu.h), printed and logged.
void evaluate_choices(cpu::GPT2<float>& model, const Options& o, const Plan& plan, Outputs& out, int step,
                      int max_steps) {
    const auto t0 = std::chrono::steady_clock::now();
    const McResult r = mc_eval_cpu(model, plan.eval, o.B, o.T);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("step %5d/%d | eval acc %.4f | acc_norm %.4f | %lld items in %.2f s\n", step, max_steps, r.acc(),
                r.acc_norm(), (long long)r.items, seconds);
    std::fflush(stdout);
    out.write(format("{\"step\":%d,\"eval_acc\":%.6f,\"eval_acc_norm\":%.6f,\"eval_items\":%lld,\"eval_s\":%.3f}",
                     step, r.acc(), r.acc_norm(), (long long)r.items, seconds));
}

}  // namespace

int main(int argc, char** argv) {
    const auto started = std::chrono::steady_clock::now();
    return run_main([&]() -> int {
        // Flags, then the output directory: a mistake in either ends the run before any work. An earlier
        // run's log.jsonl there is replaced only once the model, the plan, the data and the memory are
        // checked and the model is built too.
        Options opt;
        Flags flags = trainer_flags(opt);
        if (!flags.parse(argc, argv)) return kExitOk;
        check_options(flags, opt);
        Outputs out(opt.output_dir);

        // The model's shape, the plan, the memory the run needs (before any is allocated) and the data.
        const ModelSource source = resolve_model(opt);
        Plan plan = plan_run(flags, opt, source.config);
        check_host_memory(opt, plan, source.config);
        Data data(opt, source.config, plan);
        if (plan.gen_tokens > 0) out.load_tokenizer(opt.tokenizer);
        print_startup(flags, opt, plan, source, data);
        cpu::GPT2<float> model(source.config);
        load_parameters(model, source, uint64_t(opt.seed));
        if (data.train) model.reserve(opt.B, opt.T);
        out.open_log(opt.max_steps == 0, opt.model);
        RunControl::Limits limits;
        limits.max_bad_steps = opt.max_bad_steps;
        limits.checkpoints = false;
        RunControl guard(limits, started);  // the step guard's count of skipped steps in a row

        // The loop: evaluate and sample between steps (and after the last), train in between.
        Batch batch;
        Throughput tp;
        double first_val = NAN, last_val = NAN;
        for (int step = 0; step <= data.max_steps; step++) {
            const bool last = step == data.max_steps;
            if (data.val && (step % opt.val_every == 0 || last)) {
                last_val = evaluate(model, *data.val, data.val_steps, opt.B, opt.T, batch);
                if (std::isnan(first_val)) first_val = last_val;
                std::printf("step %5d/%d | val loss %.6f\n", step, data.max_steps, last_val);
                std::fflush(stdout);
                out.write(format("{\"step\":%d,\"val_loss\":%s}", step, json_number(last_val, "%.9g").c_str()));
            }
            if (!plan.eval.items.empty() && ((opt.eval_every > 0 && step % opt.eval_every == 0) || last)) {
                evaluate_choices(model, opt, plan, out, step, data.max_steps);
            }
            if (plan.gen_tokens > 0 && ((step > 0 && step % opt.sample_every == 0) || last)) {
                print_sample(model, opt, plan, out, step);
            }
            if (last) break;
            const double lr = plan.schedule.at(step);
            const StepStats s = train_step(model, *data.train, opt, plan.grad_accum, step, lr, batch);
            tp.add(step, data.max_steps, s.seconds);
            log_step(out, tp, plan, step, data.max_steps, lr, s,
                     (step + 1) % opt.log_every == 0 || step + 1 == data.max_steps || !s.skipped.empty());
            guard.after_step(step + 1, s.loss, s.skipped);
        }

        // The summary and the trained model.
        if (tp.steps > 0) {
            std::printf("average over %d steps: %.0f ms/step, %.0f tok/s\n", tp.steps, 1e3 * tp.per_step(0),
                        double(plan.tokens_per_step) / tp.per_step(0));
        }
        if (data.val) std::printf("val loss: %.6f -> %.6f\n", first_val, last_val);
        save_models(model, opt, plan, out, data.max_steps);
        return int(kExitOk);
    });
}
