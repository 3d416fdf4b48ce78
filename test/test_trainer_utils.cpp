/*
CPU tests of the trainer's small utilities: the flag table (parsing, errors, generated usage and
settings table), the learning-rate schedules and MFU arithmetic (llmc/schedule.h), the token
sampler both trainers use (llmc/sampler.h) and what a sample starts from and prints as (llmc/prompt.h).
*/
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "llmc/flags.h"
#include "llmc/prompt.h"
#include "llmc/sampler.h"
#include "llmc/schedule.h"

using namespace llmc;

namespace {

struct Settings {
    int batch = 4;
    int64_t steps = -1;
    float lr = 3e-4f;
    std::string model = "d12";
    bool resume = false;
};

Flags make_flags(Settings& s) {
    Flags f("train", "test program");
    f.add("b", "batch-size", &s.batch, "micro-batch size B")
        .add("x", "max-steps", &s.steps, "steps to train")
        .add("l", "learning-rate", &s.lr, "peak learning rate")
        .add("e", "model", &s.model, "descriptor or model file")
        .add("y", "resume", &s.resume, "resume from the newest checkpoint");
    return f;
}

bool parse(Flags& f, std::vector<std::string> args) {
    std::vector<char*> argv;
    static std::string prog = "train";
    argv.push_back(prog.data());
    for (auto& a : args) argv.push_back(a.data());
    return f.parse(int(argv.size()), argv.data());
}

// The features the data tools use: ranges, switches, repeatable flags and positional arguments.
struct ToolSettings {
    int threads = 4;
    int64_t tokens = 100;
    double fraction = 0.5;
    bool quiet = false;
    std::vector<std::string> val;
    std::vector<std::string> inputs;
};

Flags make_tool_flags(ToolSettings& s) {
    Flags f("tool", "test tool");
    f.add("", "threads", &s.threads, "worker threads", 1, 1024)
        .add("", "tokens", &s.tokens, "tokens per shard", 1, int64_t(1) << 40)
        .add("", "fraction", &s.fraction, "a fraction", 0, 1)
        .add_switch("q", "quiet", &s.quiet, "print errors only")
        .add("", "val", &s.val, "validation input; repeatable")
        .positional("INPUT", &s.inputs, "training inputs");
    return f;
}

// Parses args into a fresh table from `make`; returns the usage error's exit code and message, or 0.
template <class S>
int usage_error(Flags (*make)(S&), std::vector<std::string> args, std::string* message) {
    S s;
    Flags f = make(s);
    try {
        parse(f, std::move(args));
    } catch (const Error& e) {
        *message = e.what();
        return e.exit_code();
    }
    return 0;
}
int usage_error(std::vector<std::string> args, std::string* message) {
    return usage_error(make_flags, std::move(args), message);
}
int tool_usage_error(std::vector<std::string> args, std::string* message) {
    return usage_error(make_tool_flags, std::move(args), message);
}

}  // namespace

TEST(Flags, ShortLongAndInlineForms) {
    Settings s;
    Flags f = make_flags(s);
    ASSERT_TRUE(parse(f, {"-b", "16", "--max-steps", "2k", "--learning-rate=0.001", "-e", "d24", "-y", "1"}));
    EXPECT_EQ(s.batch, 16);
    EXPECT_EQ(s.steps, 2000);
    EXPECT_FLOAT_EQ(s.lr, 0.001f);
    EXPECT_EQ(s.model, "d24");
    EXPECT_TRUE(s.resume);
    EXPECT_TRUE(f.was_set("batch-size"));
}

TEST(Flags, DefaultsStayWhenNotGiven) {
    Settings s;
    Flags f = make_flags(s);
    ASSERT_TRUE(parse(f, {}));
    EXPECT_EQ(s.batch, 4);
    EXPECT_EQ(s.model, "d12");
    EXPECT_FALSE(f.was_set("batch-size"));
}

TEST(Flags, ErrorsNameTheFlag) {
    std::string m;
    EXPECT_EQ(usage_error({"--bogus", "1"}, &m), kExitUsage);
    EXPECT_EQ(m, "unknown flag '--bogus' (see train --help)");
    EXPECT_EQ(usage_error({"-b"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag -b needs a value (micro-batch size B)");
    EXPECT_EQ(usage_error({"-b", "12x"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag -b: '12x' is not an integer");
    EXPECT_EQ(usage_error({"-b", "99999999999"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag -b: '99999999999' is not a 32-bit integer");
    EXPECT_EQ(usage_error({"-l", "fast"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag -l: 'fast' is not a number");
    EXPECT_EQ(usage_error({"-y", "yes"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag -y: 'yes' is not 0, 1, true or false");
}

// An integer flag takes exactly the whole numbers it is given: nothing is truncated, rounded or wrapped.
TEST(Flags, IntegersAreExactOrRefused) {
    const std::vector<std::pair<std::string, int64_t>> good = {
        {"0", 0},        {"-0", 0},        {"+7", 7},         {"-4", -4},         {"2.0", 2},
        {"1e6", 1000000}, {"1E3", 1000},   {"2.5e3", 2500},   {"2.50e1", 25},     {"100000e-5", 1},
        {"3k", 3000},    {"2.5k", 2500},   {"1.5M", 1500000}, {"7m", 7000000},    {"0e99999999", 0},
        {"9223372036854775807", INT64_MAX}, {"-9223372036854775808", INT64_MIN},
        {"9.223372036854775807e18", INT64_MAX}};
    for (const auto& [text, want] : good) {
        Settings s;
        Flags f = make_flags(s);
        ASSERT_TRUE(parse(f, {"-x", text})) << text;
        EXPECT_EQ(s.steps, want) << text;
    }
    for (const std::string text : {"2.5", "-2.5", "0.5", "2.5e0", "25e-1", "1.0000000000000001", "1.2345k", "1e-1",
                                   "9223372036854775808", "-9223372036854775809", "9223372036854775807k", "1e19",
                                   "1e999999999", "0x10", " 5", "5 ", "", "+", ".", "-", "1e", "e5", "3kk", "k",
                                   "nan", "inf", "1,000", "12x"}) {
        std::string m;
        EXPECT_EQ(usage_error({"--max-steps", text}, &m), kExitUsage) << "'" << text << "' was accepted";
        EXPECT_EQ(m, "flag --max-steps: '" + text + "' is not an integer");
    }
    // A 32-bit flag gets the same parsing and then its own range.
    std::string m;
    EXPECT_EQ(usage_error({"-b", "2.5"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag -b: '2.5' is not an integer");
    EXPECT_EQ(usage_error({"-b", "2.5k"}, &m), 0);
    EXPECT_EQ(usage_error({"-b", "2147483648"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag -b: '2147483648' is not a 32-bit integer");
    EXPECT_EQ(usage_error({"-b", "-2147483648"}, &m), 0);
    EXPECT_EQ(tool_usage_error({"--threads", "1.5"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag --threads: '1.5' is not an integer");
}

TEST(Flags, UsageAndSettingsComeFromTheTable) {
    Settings s;
    Flags f = make_flags(s);
    std::string u = f.usage();
    for (const char* name : {"-b, --batch-size", "-x, --max-steps", "-l, --learning-rate", "-e, --model", "-y, --resume"}) {
        EXPECT_NE(u.find(name), std::string::npos) << name << " missing from\n" << u;
    }
    EXPECT_NE(u.find("micro-batch size B (default: 4)"), std::string::npos) << u;
    ASSERT_TRUE(parse(f, {"-b", "8"}));
    std::string t = f.settings_table();
    EXPECT_NE(t.find("| batch-size                       | 8 *"), std::string::npos) << t;
    EXPECT_NE(t.find("| model                            | d12 "), std::string::npos) << t;
}

TEST(Flags, HelpStopsParsing) {
    Settings s;
    Flags f = make_flags(s);
    testing::internal::CaptureStdout();
    EXPECT_FALSE(parse(f, {"--help"}));
    std::string out = testing::internal::GetCapturedStdout();
    EXPECT_NE(out.find("usage: train [flags]"), std::string::npos);
}

TEST(Flags, SwitchesRepeatsAndPositionals) {
    ToolSettings s;
    Flags f = make_tool_flags(s);
    ASSERT_TRUE(parse(f, {"a.txt", "--val", "v1", "-q", "--threads=3", "b", "--val=v2", "-", "--tokens", "1099511627776"}));
    EXPECT_EQ(s.inputs, (std::vector<std::string>{"a.txt", "b", "-"}));
    EXPECT_EQ(s.val, (std::vector<std::string>{"v1", "v2"}));
    EXPECT_TRUE(s.quiet);
    EXPECT_EQ(s.threads, 3);
    EXPECT_EQ(s.tokens, int64_t(1) << 40);
    EXPECT_TRUE(f.was_set("val"));
    EXPECT_FALSE(f.was_set("fraction"));
    std::string t = f.settings_table();
    EXPECT_NE(t.find("| val                              | v1,v2 *"), std::string::npos) << t;
    EXPECT_NE(t.find("| quiet                            | 1 *"), std::string::npos) << t;
    std::string u = f.usage();
    EXPECT_NE(u.find("usage: tool [flags] INPUT..."), std::string::npos) << u;
    EXPECT_NE(u.find("worker threads (default: 4, from 1 to 1024)"), std::string::npos) << u;
    EXPECT_NE(u.find("a fraction (default: 0.5, from 0 to 1)"), std::string::npos) << u;
    EXPECT_NE(u.find("--val <string>..."), std::string::npos) << u;
    EXPECT_NE(u.find("-q, --quiet                    print errors only\n"), std::string::npos) << u;
}

// Flags added after group() are listed apart, after -h, under the group's heading; they parse as any other.
TEST(Flags, GroupedFlagsComeLastUnderTheirHeading) {
    Settings s;
    int hook = 0;
    Flags f = make_flags(s);
    f.group("for tests:").add("", "hook", &hook, "a test hook");
    f.add("k", "kept", &s.batch, "also in the group");
    const std::string u = f.usage();
    const size_t help = u.find("-h, --help"), heading = u.find("\nfor tests:\n"), hook_line = u.find("--hook <int>");
    ASSERT_NE(heading, std::string::npos) << u;
    EXPECT_LT(u.find("-y, --resume"), help) << u;
    EXPECT_LT(help, heading) << u;
    EXPECT_LT(heading, hook_line) << u;
    EXPECT_LT(hook_line, u.find("-k, --kept")) << u;
    EXPECT_EQ(u.find("for tests:", heading + 2), std::string::npos) << "one heading per group\n" << u;
    ASSERT_TRUE(parse(f, {"--hook", "3", "-b", "2"}));
    EXPECT_EQ(hook, 3);
    EXPECT_NE(f.settings_table().find("| hook                             | 3 *"), std::string::npos) << f.settings_table();
}

TEST(Flags, RangesSwitchesAndPositionalsAreChecked) {
    std::string m;
    EXPECT_EQ(tool_usage_error({"--threads", "0"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag --threads: '0' is not an integer from 1 to 1024");
    EXPECT_EQ(tool_usage_error({"--threads=1025"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag --threads: '1025' is not an integer from 1 to 1024");
    // Checked before narrowing to 32 bits: 2^32 + 1 must not wrap around into the range.
    EXPECT_EQ(tool_usage_error({"--threads", "4294967297"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag --threads: '4294967297' is not an integer from 1 to 1024");
    EXPECT_EQ(tool_usage_error({"--tokens", "1099511627777"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag --tokens: '1099511627777' is not an integer from 1 to 1099511627776");
    EXPECT_EQ(tool_usage_error({"--fraction", "1.5"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag --fraction: '1.5' is not a number from 0 to 1");
    EXPECT_EQ(tool_usage_error({"--fraction", "nan"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag --fraction: 'nan' is not a number from 0 to 1");
    EXPECT_EQ(tool_usage_error({"--quiet=1"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag --quiet takes no value");
    EXPECT_EQ(tool_usage_error({"--val"}, &m), kExitUsage);
    EXPECT_EQ(m, "flag --val needs a value (validation input; repeatable)");
    EXPECT_EQ(tool_usage_error({"--threads", "2", "--fraction", "1", "--quiet", "in"}, &m), 0);
    // A program without positional() refuses them.
    EXPECT_EQ(usage_error({"-b", "8", "stray"}, &m), kExitUsage);
    EXPECT_EQ(m, "unexpected argument 'stray': train takes flags only (see train --help)");
}

TEST(LRSchedule, WarmupThenCosineToTheFloor) {
    LRSchedule s;
    s.kind = LRSchedule::Kind::Cosine;
    s.lr = 1e-3;
    s.warmup = 10;
    s.total = 110;
    s.final_fraction = 0.1;
    EXPECT_DOUBLE_EQ(s.at(0), 1e-4);
    EXPECT_DOUBLE_EQ(s.at(9), 1e-3);
    EXPECT_DOUBLE_EQ(s.at(10), 1e-3);
    EXPECT_NEAR(s.at(60), 1e-4 + 0.5 * 9e-4, 1e-15);  // halfway through the decay
    EXPECT_GT(s.at(109), 1e-4);
    EXPECT_LT(s.at(109), 1.01e-4);
    for (int i = 11; i < 110; i++) EXPECT_LT(s.at(i), s.at(i - 1)) << i;
}

TEST(LRSchedule, LinearConstantAndWSD) {
    LRSchedule s;
    s.lr = 1.0;
    s.warmup = 0;
    s.total = 100;
    s.final_fraction = 0.0;
    s.kind = LRSchedule::Kind::Linear;
    EXPECT_DOUBLE_EQ(s.at(0), 1.0);
    EXPECT_DOUBLE_EQ(s.at(50), 0.5);
    s.kind = LRSchedule::Kind::Constant;
    EXPECT_DOUBLE_EQ(s.at(99), 1.0);
    s.kind = LRSchedule::Kind::WSD;
    s.decay_fraction = 0.2;
    EXPECT_DOUBLE_EQ(s.at(79), 1.0);
    EXPECT_DOUBLE_EQ(s.at(80), 1.0);
    EXPECT_DOUBLE_EQ(s.at(90), 0.5);
    EXPECT_NEAR(s.at(99), 0.05, 1e-12);
    EXPECT_THROW(LRSchedule::parse_kind("step"), Error);
    EXPECT_EQ(LRSchedule::parse_kind("wsd"), LRSchedule::Kind::WSD);
}

// A decay fraction that reaches into the warmup starts the decay where the warmup ends, not before.
TEST(LRSchedule, WSDDecayStartsNoEarlierThanTheWarmupEnds) {
    LRSchedule s;
    s.kind = LRSchedule::Kind::WSD;
    s.lr = 2e-3;
    s.warmup = 10;
    s.total = 20;
    s.decay_fraction = 0.8;
    s.final_fraction = 0.25;
    EXPECT_DOUBLE_EQ(s.at(9), 2e-3);
    EXPECT_EQ(s.at(10), 2e-3) << "the full lr at the first step after the warmup";
    EXPECT_DOUBLE_EQ(s.at(15), 2e-3 + (5e-4 - 2e-3) * 0.5);
    EXPECT_DOUBLE_EQ(s.at(19), 2e-3 + (5e-4 - 2e-3) * 0.9);
}

// From the planned end on, every schedule stays exactly at its floor (lr * final_fraction; lr for
// constant), for any learning rate, floor and warmup, including a warmup longer than the run.
TEST(LRSchedule, PastTheEndEverySchedulesStaysAtItsFloor) {
    using Kind = LRSchedule::Kind;
    int checked = 0;
    for (Kind kind : {Kind::Cosine, Kind::Linear, Kind::Constant, Kind::WSD}) {
        for (double lr : {6e-4, 1e-3, 3e-4, 0.1, 7e-5}) {
            for (double fraction : {0.0, 0.1, 0.3, 1.0 / 3.0, 0.5}) {
                for (int warmup : {0, 1, 7, 20, 150}) {
                    for (int total : {1, 2, 20, 97, 1000}) {
                        LRSchedule s;
                        s.kind = kind;
                        s.lr = lr;
                        s.final_fraction = fraction;
                        s.warmup = warmup;
                        s.total = total;
                        s.decay_fraction = 0.3;
                        const double floor = kind == Kind::Constant ? lr : lr * fraction;
                        for (int k : {0, 1, 2, 10, 1000000}) {
                            ASSERT_EQ(s.at(total + k), floor) << "kind " << int(kind) << " lr " << lr << " fraction "
                                                              << fraction << " warmup " << warmup << " total " << total
                                                              << " k " << k;
                            checked++;
                        }
                        // Before the end the schedule does not undercut the floor either once the warmup is over.
                        for (int step = std::min(warmup, total); step < total; step++) ASSERT_GE(s.at(step), floor);
                    }
                }
            }
        }
    }
    EXPECT_EQ(checked, 4 * 5 * 5 * 5 * 5 * 5);
}

TEST(MFU, KnownAndUnknownGPUs) {
    EXPECT_DOUBLE_EQ(peak_bf16_flops("NVIDIA H200"), 989e12);
    EXPECT_DOUBLE_EQ(peak_bf16_flops("NVIDIA H100 80GB HBM3"), 989e12);
    EXPECT_DOUBLE_EQ(peak_bf16_flops("NVIDIA H100 PCIe"), 756e12);
    EXPECT_DOUBLE_EQ(peak_bf16_flops("NVIDIA A100-SXM4-80GB"), 312e12);
    EXPECT_DOUBLE_EQ(peak_bf16_flops("Some Future GPU"), 0.0);
    EXPECT_LT(mfu(1e9, 1e5, 0.0), 0.0);
    EXPECT_NEAR(mfu(1e9, 1e5, 1e15), 0.1, 1e-12);
}

TEST(Sampler, GreedyTopKAndSeeds) {
    std::vector<float> logits(1000);
    std::mt19937_64 gen(5);
    std::normal_distribution<float> dist(0.0f, 2.0f);
    for (float& x : logits) x = dist(gen);
    logits[617] = 20.0f;
    SplitMix64 rng(1);
    EXPECT_EQ(sample_token(logits, 0.0f, 0, rng), 617u) << "temperature 0 is greedy";
    EXPECT_EQ(sample_token(logits, 1.0f, 1, rng), 617u) << "top-k 1 is greedy";
    // Top-k 5 never leaves the 5 largest; the same seed gives the same sequence.
    std::vector<int> order(1000);
    for (int i = 0; i < 1000; i++) order[size_t(i)] = i;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[size_t(a)] > logits[size_t(b)]; });
    logits[617] = logits[size_t(order[1])];  // a flat top, so several tokens are drawn
    SplitMix64 r1(9), r2(9);
    std::vector<uint32_t> s1, s2;
    for (int i = 0; i < 200; i++) {
        s1.push_back(sample_token(logits, 1.0f, 5, r1));
        s2.push_back(sample_token(logits, 1.0f, 5, r2));
    }
    EXPECT_EQ(s1, s2);
    std::sort(order.begin(), order.end(), [&](int a, int b) {
        return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
    });
    std::vector<uint32_t> top5(order.begin(), order.begin() + 5);
    int distinct = 0;
    std::vector<bool> seen(1000, false);
    for (uint32_t id : s1) {
        EXPECT_NE(std::find(top5.begin(), top5.end(), id), top5.end()) << "token " << id << " is not in the top 5";
        if (!seen[id]) distinct++;
        seen[id] = true;
    }
    EXPECT_GE(distinct, 2) << "temperature 1 over a flat top must not always pick one token";
}

// A model's vocabulary need not be the tokenizer's: a sample's first token must be one the model has, and
// ids the tokenizer lacks print as numbers instead of failing the run.
TEST(Sample, StartAndTextFitTheModelAndTheTokenizer) {
    const Tokenizer gpt2_like(std::vector<std::string>(50257, "x"), 50256);
    const Tokenizer small({"a", "b", "c"}, 2);
    EXPECT_EQ(sample_start({5, 7}, &gpt2_like, 97), (std::vector<uint32_t>{5, 7})) << "the prompt as given";
    EXPECT_EQ(sample_start({}, &gpt2_like, 50257), (std::vector<uint32_t>{50256}));
    EXPECT_EQ(sample_start({}, &gpt2_like, 97), (std::vector<uint32_t>{96})) << "inside a 97-token vocabulary";
    EXPECT_EQ(sample_start({}, nullptr, 97), (std::vector<uint32_t>{96}));
    EXPECT_EQ(sample_start({}, nullptr, 50304), (std::vector<uint32_t>{50256}));
    EXPECT_EQ(sample_start({}, &small, 50257), (std::vector<uint32_t>{2})) << "the tokenizer's end-of-text id";
    EXPECT_EQ(sample_text(&small, {0, 1, 2, 0}), "abca");
    EXPECT_EQ(sample_text(&small, {0, 3, 1}), "0 3 1 ") << "an id past the tokenizer prints the ids";
    EXPECT_EQ(sample_text(nullptr, {0, 1}), "0 1 ");
    EXPECT_EQ(sample_text(&small, {}), "");
}
