/*
train_gpt2: GPT-2 training on the CPU with the fp32 reference model (llmc/gpt2_cpu.h), the quick start
for a machine without a GPU and a way to train tiny models.

It builds a model from a descriptor (d2, d6, d12, ...), from explicit --layers/--channels/--heads, or
loads an llm.c model file; reads token shards (llmc/shard.h, uint16 or uint32 tokens) in order, B*T+1
consecutive tokens per batch, wrapping around at the end; trains with AdamW (decay on matrices only)
and global-norm clipping at a constant learning rate; prints the train loss every step and the
validation loss (over the first --val-batches batches of the validation shards) every --val-every
steps and at the end; can write the result as a model file; and with --gen-tokens N prints N tokens
sampled from the trained model after an end-of-text token (llmc/sampler.h, the GPU trainer's sampler;
decoded with --tokenizer, or printed as ids where that file is missing).

Does not provide: learning-rate schedules, gradient accumulation, shuffling, checkpoints with
optimizer state, a KV cache for sampling (each token reruns the forward over the tokens so far) or a
GPU; the GPU trainer (train_gpt2.cu) has those.
*/
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <glob.h>
#include <omp.h>
#include <sys/stat.h>

#include "llmc/flags.h"
#include "llmc/gpt2_config.h"
#include "llmc/gpt2_cpu.h"
#include "llmc/model_file.h"
#include "llmc/sampler.h"
#include "llmc/shard.h"
#include "llmc/tokenizer.h"
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
    int64_t seed = 1337;
    std::string out;
    int out_version = kModelVersionFp32;
    int gen_tokens = 0;  // 0: no sample
    float temperature = 1.0f;
    int top_k = 0;
    int64_t sample_seed = 42;
    std::string tokenizer = "data/gpt2_tokenizer.bin";
};

// Returns false when --help was given. Checks what one flag's type and range cannot say.
bool parse_args(int argc, char** argv, Options& o) {
    Flags flags("train_gpt2", "Trains GPT-2 on the CPU (fp32 reference implementation; threads: OMP_NUM_THREADS).");
    flags.add("", "train", &o.train_pattern, "training shards (a glob)")
        .add("", "val", &o.val_pattern, "validation shards (a glob), or 'none'")
        .add("", "model", &o.model, "d2, d6, d12, d24, d36, d48, or a model file to start from (d2 when empty)")
        .add("", "layers", &o.layers, "explicit shape: layers (with --channels and --heads, instead of a descriptor)", 1, 4096)
        .add("", "channels", &o.channels, "explicit shape: channels", 1, 65536)
        .add("", "heads", &o.heads, "explicit shape: attention heads", 1, 65536)
        .add("", "vocab", &o.vocab, "explicit shape: vocabulary size", 1, 1 << 24)
        .add("", "max-seq-len", &o.max_seq_len, "explicit shape: position embeddings", 1, 1 << 20)
        .add("", "batch", &o.batch, "sequences per batch", 1, 1 << 16)
        .add("", "seq", &o.seq, "tokens per sequence", 1, 1 << 20)
        .add("", "steps", &o.steps, "optimizer steps", 0, 1 << 30)
        .add("", "lr", &o.adamw.learning_rate, "learning rate", 0, 10)
        .add("", "wd", &o.adamw.weight_decay, "AdamW weight decay on the matrices", 0, 10)
        .add("", "beta1", &o.adamw.beta1, "AdamW beta1", 0, 0.999999)
        .add("", "beta2", &o.adamw.beta2, "AdamW beta2", 0, 0.999999)
        .add("", "eps", &o.adamw.eps, "AdamW epsilon", 0, 1)
        .add("", "clip", &o.clip, "clip the global gradient norm to this; 0 = off", 0, 1e30)
        .add("", "val-every", &o.val_every, "validation loss every N steps", 1, 1 << 30)
        .add("", "val-batches", &o.val_batches, "batches in one validation pass", 1, 1 << 30)
        .add("", "seed", &o.seed, "initialisation seed for a new model", 0, INT64_MAX)
        .add("", "out", &o.out, "write the trained model here at the end")
        .add("", "out-version", &o.out_version, "model file precision: 3 = fp32, 5 = bf16", 3, 5)
        .add("", "gen-tokens", &o.gen_tokens, "at the end, sample this many tokens (0: no sample)", 0, 1 << 20)
        .add("", "temperature", &o.temperature, "sampling temperature (0: greedy)", 0, 1e6)
        .add("", "top-k", &o.top_k, "sample from the k most likely tokens (0: all)", 0, 1 << 30)
        .add("", "sample-seed", &o.sample_seed, "seed of the sampler", 0, INT64_MAX)
        .add("", "tokenizer", &o.tokenizer, "tokenizer file for decoding the sample (ids are printed without it)");
    if (!flags.parse(argc, argv)) return false;

    if (o.val_pattern == "none") o.val_pattern.clear();
    if (o.out_version == 4) fail(kExitUsage, "--out-version expects 3 (fp32) or 5 (bf16), got 4");
    int explicit_shape = (o.layers > 0) + (o.channels > 0) + (o.heads > 0);
    if (explicit_shape != 0 && explicit_shape != 3) {
        fail(kExitUsage, "an explicit shape needs all of --layers, --channels and --heads");
    }
    if (explicit_shape == 3 && !o.model.empty()) {
        fail(kExitUsage, "give either --model or an explicit shape (--layers, --channels, --heads), not both");
    }
    if (o.model.empty()) o.model = "d2";
    std::fputs(flags.settings_table().c_str(), stdout);
    return true;
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

// --gen-tokens tokens after an end-of-text token (B = 1, the forward rerun over the tokens so far for each),
// printed as text when the tokenizer file is there, else as ids.
void print_sample(cpu::GPT2<float>& model, const Options& o) {
    const GPT2Config& c = model.config();
    Tokenizer tok;
    const bool have_tokenizer = is_file(o.tokenizer);
    if (have_tokenizer) {
        tok = read_tokenizer_bin(o.tokenizer);
    } else {
        std::printf("note: tokenizer '%s' not found; the sample is printed as token ids\n", o.tokenizer.c_str());
    }
    const uint32_t start = have_tokenizer ? tok.eot() : std::min(kGpt2EotToken, uint32_t(c.vocab_size - 1));
    std::vector<int> tokens{int(start)};
    std::vector<uint32_t> out;
    std::vector<float> row(size_t(c.vocab_size));
    SplitMix64 rng(uint64_t(o.sample_seed));
    for (int i = 0; i < o.gen_tokens; i++) {
        const int t = int(tokens.size());
        model.forward(tokens.data(), nullptr, 1, t);
        const float* logits = model.activations().logits.data() + size_t(t - 1) * c.padded_vocab_size;
        std::copy(logits, logits + c.vocab_size, row.begin());
        const uint32_t next = sample_token(row, o.temperature, o.top_k, rng);
        tokens.push_back(int(next));
        out.push_back(next);
    }
    std::string text;
    if (have_tokenizer) {
        text = tok.decode(out);
    } else {
        for (uint32_t id : out) text += std::to_string(id) + " ";
    }
    std::printf("---------- sample ----------\n%s\n----------------------------\n", text.c_str());
}

int train(const Options& o) {
    cpu::GPT2<float> model = build_model(o);
    const GPT2Config& c = model.config();
    const int B = o.batch, T = o.seq;
    if (T > c.max_seq_len) fail(kExitUsage, "--seq %d is longer than the model's max_seq_len %d", T, c.max_seq_len);
    if (o.gen_tokens > c.max_seq_len - 1) {
        fail(kExitUsage, "--gen-tokens %d: at most the model's max_seq_len - 1 = %d", o.gen_tokens, c.max_seq_len - 1);
    }
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
    if (o.gen_tokens > 0) print_sample(model, o);
    if (!o.out.empty()) {
        std::vector<float> p = model.params_as_float();
        write_model_file(o.out, c, p.data(), o.out_version);
        std::printf("wrote %s (version %d)\n", o.out.c_str(), o.out_version);
    }
    return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&] {
        Options o;
        return parse_args(argc, argv, o) ? train(o) : kExitOk;
    });
}
