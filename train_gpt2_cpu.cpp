/*
train_gpt2: GPT-2 training on the CPU with the fp32 reference model (llmc/gpt2_cpu.h), the quick start
for a machine without a GPU and a way to train tiny models.

It builds a model from a descriptor (d2, d6, d12, ...), from explicit --layers/--channels/--heads, or
loads an llm.c model file; reads token shards (llmc/shard.h, uint16 or uint32 tokens) in order, B*T+1
consecutive tokens per batch, wrapping around at the end; trains with AdamW (decay on matrices only)
and global-norm clipping at a constant learning rate; prints the train loss every step and the
validation loss (over the first --val-batches batches of the validation shards) every --val-every
steps and at the end; and can write the result as a model file.

Does not provide: learning-rate schedules, gradient accumulation, shuffling, checkpoints with
optimizer state, sampling or a GPU; the GPU trainer (train_gpt2.cu) has those.
*/
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <glob.h>
#include <omp.h>
#include <sys/stat.h>

#include "llmc/gpt2_config.h"
#include "llmc/gpt2_cpu.h"
#include "llmc/model_file.h"
#include "llmc/shard.h"
#include "llmc/utils.h"

using namespace llmc;

namespace {

struct Options {
    std::string train_pattern = "data/quickstart_train_*.bin";
    std::string val_pattern = "data/quickstart_val_*.bin";
    std::string model;  // descriptor or model file; d2 when neither this nor an explicit shape is given
    int layers = 0, channels = 0, heads = 0;
    int vocab = kGPT2VocabSize;
    int max_seq_len = kGPT2MaxSeqLen;
    int batch = 4, seq = 64, steps = 50;
    cpu::AdamW adamw{1e-3, 0.9, 0.95, 1e-8, 0.1};
    double clip = 1.0;
    int val_every = 10, val_batches = 8;
    uint64_t seed = 1337;
    std::string out;
    int out_version = kModelVersionFp32;
};

int64_t parse_int(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
    char* end = nullptr;
    errno = 0;
    long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || errno != 0 || x < lo || x > hi) {
        fail(kExitUsage, "%s expects an integer from %lld to %lld, got '%s'", flag.c_str(), (long long)lo, (long long)hi,
             v.c_str());
    }
    return x;
}

double parse_double(const std::string& flag, const std::string& v, double lo, double hi) {
    char* end = nullptr;
    double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(x >= lo && x <= hi)) {
        fail(kExitUsage, "%s expects a number from %g to %g, got '%s'", flag.c_str(), lo, hi, v.c_str());
    }
    return x;
}

struct Flag {
    const char* name;
    const char* arg;
    const char* help;
    std::function<void(Options&, const std::string&)> set;
};

const std::vector<Flag>& flags() {
    auto i32 = [](int Options::*field, const char* name, int lo, int hi) {
        return [=](Options& o, const std::string& v) { o.*field = int(parse_int(name, v, lo, hi)); };
    };
    auto real = [](double cpu::AdamW::*field, const char* name, double lo, double hi) {
        return [=](Options& o, const std::string& v) { o.adamw.*field = parse_double(name, v, lo, hi); };
    };
    static const std::vector<Flag> table = {
        {"--train", "GLOB", "training shards (default data/quickstart_train_*.bin)",
         [](Options& o, const std::string& v) { o.train_pattern = v; }},
        {"--val", "GLOB", "validation shards, or 'none' (default data/quickstart_val_*.bin)",
         [](Options& o, const std::string& v) { o.val_pattern = v == "none" ? "" : v; }},
        {"--model", "D|FILE", "d2, d6, d12, d24, d36, d48, or a model file to start from (default d2)",
         [](Options& o, const std::string& v) { o.model = v; }},
        {"--layers", "L", "explicit shape: layers (with --channels and --heads, instead of a descriptor)",
         i32(&Options::layers, "--layers", 1, 4096)},
        {"--channels", "C", "explicit shape: channels", i32(&Options::channels, "--channels", 1, 65536)},
        {"--heads", "NH", "explicit shape: attention heads", i32(&Options::heads, "--heads", 1, 65536)},
        {"--vocab", "V", "explicit shape: vocabulary size (default 50257)", i32(&Options::vocab, "--vocab", 1, 1 << 24)},
        {"--max-seq-len", "N", "explicit shape: position embeddings (default 1024)",
         i32(&Options::max_seq_len, "--max-seq-len", 1, 1 << 20)},
        {"--batch", "B", "sequences per batch (default 4)", i32(&Options::batch, "--batch", 1, 1 << 16)},
        {"--seq", "T", "tokens per sequence (default 64)", i32(&Options::seq, "--seq", 1, 1 << 20)},
        {"--steps", "N", "optimizer steps (default 50)", i32(&Options::steps, "--steps", 0, 1 << 30)},
        {"--lr", "X", "learning rate (default 1e-3)", real(&cpu::AdamW::learning_rate, "--lr", 0, 10)},
        {"--wd", "X", "AdamW weight decay on the matrices (default 0.1)",
         real(&cpu::AdamW::weight_decay, "--wd", 0, 10)},
        {"--beta1", "X", "AdamW beta1 (default 0.9)", real(&cpu::AdamW::beta1, "--beta1", 0, 0.999999)},
        {"--beta2", "X", "AdamW beta2 (default 0.95)", real(&cpu::AdamW::beta2, "--beta2", 0, 0.999999)},
        {"--eps", "X", "AdamW epsilon (default 1e-8)", real(&cpu::AdamW::eps, "--eps", 0, 1)},
        {"--clip", "X", "clip the global gradient norm to X; 0 = off (default 1.0)",
         [](Options& o, const std::string& v) { o.clip = parse_double("--clip", v, 0, 1e30); }},
        {"--val-every", "N", "validation loss every N steps (default 10)",
         i32(&Options::val_every, "--val-every", 1, 1 << 30)},
        {"--val-batches", "N", "batches in one validation pass (default 8)",
         i32(&Options::val_batches, "--val-batches", 1, 1 << 30)},
        {"--seed", "N", "initialisation seed for a new model (default 1337)",
         [](Options& o, const std::string& v) { o.seed = uint64_t(parse_int("--seed", v, 0, INT64_MAX)); }},
        {"--out", "FILE", "write the trained model here at the end", [](Options& o, const std::string& v) { o.out = v; }},
        {"--out-version", "3|5", "model file precision: 3 = fp32 (default), 5 = bf16",
         [](Options& o, const std::string& v) {
             o.out_version = int(parse_int("--out-version", v, 3, 5));
             if (o.out_version == 4) fail(kExitUsage, "--out-version expects 3 (fp32) or 5 (bf16), got 4");
         }},
    };
    return table;
}

void print_usage(FILE* out) {
    std::fprintf(out, "usage: train_gpt2 [options]\nTrains GPT-2 on the CPU (fp32 reference implementation; threads: "
                      "OMP_NUM_THREADS).\noptions:\n");
    for (const Flag& f : flags()) {
        std::string left = std::string(f.name) + " " + f.arg;
        std::fprintf(out, "  %-22s %s\n", left.c_str(), f.help);
    }
    std::fprintf(out, "  %-22s %s\n", "-h, --help", "show this text");
}

Options parse_args(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "-h" || a == "--help") {
            print_usage(stdout);
            std::exit(kExitOk);
        }
        std::string value;
        bool inline_value = false;
        if (size_t eq = a.find('='); eq != std::string::npos) {
            value = a.substr(eq + 1);
            a = a.substr(0, eq);
            inline_value = true;
        }
        auto it = std::find_if(flags().begin(), flags().end(), [&](const Flag& f) { return a == f.name; });
        if (it == flags().end()) fail(kExitUsage, "unknown option '%s' (see --help)", argv[i]);
        if (!inline_value) {
            if (i + 1 >= argc) fail(kExitUsage, "%s needs a value (%s)", it->name, it->arg);
            value = argv[++i];
        }
        it->set(o, value);
    }
    int explicit_shape = (o.layers > 0) + (o.channels > 0) + (o.heads > 0);
    if (explicit_shape != 0 && explicit_shape != 3) {
        fail(kExitUsage, "an explicit shape needs all of --layers, --channels and --heads");
    }
    if (explicit_shape == 3 && !o.model.empty()) {
        fail(kExitUsage, "give either --model or an explicit shape (--layers, --channels, --heads), not both");
    }
    if (o.model.empty()) o.model = "d2";
    return o;
}

bool is_file(const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Training data in file order, as a flat stream of B*T+1-token windows that advance by B*T. A shard's
// leftover shorter than a window is skipped, and after the last shard the stream starts over.
class TokenStream {
public:
    TokenStream(const std::string& pattern, int vocab_size, int B, int T)
        : vocab_(vocab_size), window_(int64_t(B) * T + 1), step_(int64_t(B) * T) {
        glob_t g{};
        int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
        if (rc == 0) {
            for (size_t i = 0; i < g.gl_pathc; i++) paths_.push_back(g.gl_pathv[i]);
        }
        ::globfree(&g);
        if (paths_.empty()) {
            fail(kExitIo, "no token shards match '%s' (prepare them with `make data`, or name them with --train/--val)",
                 pattern.c_str());
        }
        std::sort(paths_.begin(), paths_.end());
        for (const std::string& p : paths_) {
            File f(p, File::Mode::Read);
            ShardHeader h = read_shard_header(f);
            counts_.push_back(h.num_tokens);
            if (h.num_tokens >= window_) windows_ += (h.num_tokens - 1) / step_;
            total_tokens_ += h.num_tokens;
        }
        if (windows_ == 0) {
            fail(kExitData, "the shards matching '%s' hold %lld tokens, none of them %lld in one shard as a batch of "
                 "B=%d x T=%d needs", pattern.c_str(), (long long)total_tokens_, (long long)window_, B, T);
        }
        reset();
    }

    int64_t batches_per_pass() const { return windows_; }
    int64_t total_tokens() const { return total_tokens_; }
    size_t num_shards() const { return paths_.size(); }

    void reset() {
        shard_ = 0;
        pos_ = 0;
        open_current();
    }

    void next(std::vector<int>& inputs, std::vector<int>& targets) {
        while (pos_ + window_ > counts_[shard_]) {
            shard_ = (shard_ + 1) % paths_.size();
            pos_ = 0;
            open_current();
        }
        const int bpt = shard_bytes_per_token(header_.version);
        raw_.resize(size_t(window_ * bpt));
        file_.seek(kShardHeaderBytes + pos_ * bpt);
        file_.read_exact(raw_.data(), raw_.size());
        tokens_.resize(size_t(window_));
        for (int64_t i = 0; i < window_; i++) {
            uint32_t id;
            if (bpt == 2) {
                uint16_t v;
                std::memcpy(&v, raw_.data() + 2 * i, 2);
                id = v;
            } else {
                std::memcpy(&id, raw_.data() + 4 * i, 4);
            }
            if (id >= uint32_t(vocab_)) {
                fail(kExitData, "shard '%s': token %lld (offset %lld) is %u, outside the model's vocabulary [0, %d)",
                     paths_[shard_].c_str(), (long long)(pos_ + i), (long long)(kShardHeaderBytes + (pos_ + i) * bpt),
                     id, vocab_);
            }
            tokens_[size_t(i)] = int(id);
        }
        inputs.assign(tokens_.begin(), tokens_.end() - 1);
        targets.assign(tokens_.begin() + 1, tokens_.end());
        pos_ += step_;
    }

private:
    void open_current() {
        file_.open(paths_[shard_], File::Mode::Read);
        header_ = read_shard_header(file_);
        counts_[shard_] = header_.num_tokens;
    }

    int vocab_;
    int64_t window_, step_;
    std::vector<std::string> paths_;
    std::vector<int64_t> counts_;
    int64_t windows_ = 0, total_tokens_ = 0;
    size_t shard_ = 0;
    int64_t pos_ = 0;
    File file_;
    ShardHeader header_;
    std::vector<char> raw_;
    std::vector<int> tokens_;
};

// The model to start from: a model file, an explicit shape or a descriptor, the latter two initialised.
cpu::GPT2<float> build_model(const Options& o) {
    if (o.layers > 0) {
        GPT2Config c = make_config(o.layers, o.channels, o.heads, o.vocab, o.max_seq_len);
        std::vector<float> p(size_t(num_parameters(c)));
        init_parameters(c, o.seed, p.data());
        std::printf("model: new, explicit shape, seed %llu\n", (unsigned long long)o.seed);
        return cpu::GPT2<float>(c, p);
    }
    if (is_file(o.model)) {
        std::vector<float> p;
        ModelFileInfo info = read_model_file(o.model, &p);
        std::printf("model: loaded from %s (version %d)\n", o.model.c_str(), info.version);
        return cpu::GPT2<float>(info.config, p);
    }
    if (o.model.find('/') != std::string::npos || o.model.find(".bin") != std::string::npos) {
        fail(kExitIo, "model file '%s' does not exist", o.model.c_str());
    }
    GPT2Config c = config_from_descriptor(o.model);
    std::vector<float> p(size_t(num_parameters(c)));
    init_parameters(c, o.seed, p.data());
    std::printf("model: new %s, seed %llu\n", o.model.c_str(), (unsigned long long)o.seed);
    return cpu::GPT2<float>(c, p);
}

double validation_loss(cpu::GPT2<float>& model, TokenStream& val, int batches, int B, int T) {
    std::vector<int> inputs, targets;
    val.reset();
    double sum = 0;
    for (int i = 0; i < batches; i++) {
        val.next(inputs, targets);
        sum += model.forward(inputs.data(), targets.data(), B, T);
    }
    return sum / batches;
}

int train(const Options& o) {
    cpu::GPT2<float> model = build_model(o);
    const GPT2Config& c = model.config();
    const int B = o.batch, T = o.seq;
    if (T > c.max_seq_len) fail(kExitUsage, "--seq %d is longer than the model's max_seq_len %d", T, c.max_seq_len);
    std::printf("config: %s, %lld parameters, %.1f MFLOP/token\n", describe(c).c_str(),
                (long long)num_parameters(c), flops_per_token(c, T) / 1e6);
    std::printf("optimizer: AdamW lr %g, betas (%g, %g), eps %g, weight decay %g on matrices, clip %g\n",
                o.adamw.learning_rate, o.adamw.beta1, o.adamw.beta2, o.adamw.eps, o.adamw.weight_decay, o.clip);

    TokenStream train(o.train_pattern, c.vocab_size, B, T);
    std::printf("train data: %s, %zu shards, %lld tokens, %lld batches of B=%d x T=%d per pass\n",
                o.train_pattern.c_str(), train.num_shards(), (long long)train.total_tokens(),
                (long long)train.batches_per_pass(), B, T);
    std::unique_ptr<TokenStream> val;
    int val_batches = 0;
    if (!o.val_pattern.empty()) {
        val = std::make_unique<TokenStream>(o.val_pattern, c.vocab_size, B, T);
        val_batches = int(std::min<int64_t>(o.val_batches, val->batches_per_pass()));
        std::printf("val data: %s, %zu shards, %lld tokens; %d batches per evaluation\n", o.val_pattern.c_str(),
                    val->num_shards(), (long long)val->total_tokens(), val_batches);
    }
    std::printf("threads: %d\n", omp_get_max_threads());

    std::vector<int> inputs, targets;
    double first_val = -1, last_val = -1;
    for (int step = 0; step <= o.steps; step++) {
        const bool last = step == o.steps;
        if (val && (step % o.val_every == 0 || last)) {
            last_val = validation_loss(model, *val, val_batches, B, T);
            if (first_val < 0) first_val = last_val;
            std::printf("step %5d | val loss %.6f\n", step, last_val);
        }
        if (last) break;
        auto t0 = std::chrono::steady_clock::now();
        train.next(inputs, targets);
        double loss = model.forward(inputs.data(), targets.data(), B, T);
        model.zero_grad();
        model.backward();
        double norm = model.grad_norm();
        model.update(o.adamw, step + 1, cpu::clip_scale(norm, o.clip));
        double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("step %5d/%d | train loss %.6f | norm %.4f | %.0f ms | %.0f tok/s\n", step + 1, o.steps, loss, norm,
                    secs * 1e3, B * T / secs);
        std::fflush(stdout);
    }
    if (val) std::printf("val loss: %.6f -> %.6f\n", first_val, last_val);
    if (!o.out.empty()) {
        std::vector<float> p = model.params_as_float();
        write_model_file(o.out, c, p.data(), o.out_version);
        std::printf("wrote %s (version %d)\n", o.out.c_str(), o.out_version);
    }
    return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&] { return train(parse_args(argc, argv)); });
}
