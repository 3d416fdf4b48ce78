// llmc/run_control.h: durations, the step guard's bookkeeping, stop requests (signals, the time limit), and
// llmc/run_settings.h: which settings a checkpoint records, a resume requires, and the ranks compare.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <string>
#include <thread>
#include <vector>

#include "llmc/run_control.h"
#include "llmc/run_settings.h"
#include "test/expect_error.h"

using namespace llmc;

TEST(Duration, AcceptsSecondsUnitsAndClockTimes) {
    EXPECT_DOUBLE_EQ(parse_duration("", "--t"), 0.0);
    EXPECT_DOUBLE_EQ(parse_duration("3600", "--t"), 3600.0);
    EXPECT_DOUBLE_EQ(parse_duration("2.5", "--t"), 2.5);
    EXPECT_DOUBLE_EQ(parse_duration("45s", "--t"), 45.0);
    EXPECT_DOUBLE_EQ(parse_duration("90m", "--t"), 5400.0);
    EXPECT_DOUBLE_EQ(parse_duration("23.5h", "--t"), 84600.0);
    EXPECT_DOUBLE_EQ(parse_duration("1:30:05", "--t"), 5405.0);
    EXPECT_DOUBLE_EQ(parse_duration("30:00", "--t"), 1800.0);
}

TEST(Duration, RefusesWhatIsNotADuration) {
    // A clock time's fields are digits, each one there: "4:" is not 4 seconds nor "1: 30" 90.
    for (const char* bad : {"soon", "1:xx", "10q", "-5", "0", "1h30", ":", "1::2", "nan", "inf", "4:", "1:30:",
                            ":30", "1: 30", "1:-30", "1:2:3:4", " 5", " 1:00", "0x10", "1e3", "1.2.3", "."}) {
        expect_error([&] { parse_duration(bad, "--time-limit"); }, kExitUsage, {"--time-limit", bad, "H:MM:SS"});
    }
}

TEST(RunControl, TooManySkippedStepsInARowEndTheRun) {
    RunControl::Limits l;
    l.max_bad_steps = 3;
    RunControl c(l, std::chrono::steady_clock::now());
    c.after_step(1, 5.0, "");
    c.after_step(2, NAN, "the gradient norm is nan");
    c.after_step(3, NAN, "a loss is not finite");
    c.after_step(4, 4.9, "");  // an applied step resets the count
    c.after_step(5, NAN, "a loss is not finite");
    c.after_step(6, NAN, "a loss is not finite");
    expect_error([&] { c.after_step(7, NAN, "the gradient norm is inf"); }, kExitDiverged,
                 {"step 7", "3 steps in a row", "the gradient norm is inf"});
}

TEST(RunControl, SpikeLimitIsAMultipleOfTheRecentMeanOnceThereAreTen) {
    RunControl::Limits l;
    l.loss_spike = 3.0f;
    RunControl c(l, std::chrono::steady_clock::now());
    for (int i = 0; i < 9; i++) c.after_step(i + 1, 2.0, "");
    EXPECT_TRUE(std::isinf(c.loss_limit()));
    c.after_step(10, 4.0, "");  // mean (9 * 2 + 4) / 10 = 2.2
    EXPECT_FLOAT_EQ(c.loss_limit(), 6.6f);
    c.after_step(11, 100.0, "the loss is a spike");  // skipped steps do not enter the mean
    EXPECT_FLOAT_EQ(c.loss_limit(), 6.6f);
    for (int i = 0; i < 60; i++) c.after_step(12 + i, 1.0, "");  // only the last 50 count
    EXPECT_FLOAT_EQ(c.loss_limit(), 3.0f);
    RunControl off(RunControl::Limits{}, std::chrono::steady_clock::now());
    for (int i = 0; i < 20; i++) off.after_step(i + 1, 1.0, "");
    EXPECT_TRUE(std::isinf(off.loss_limit()));
}

// A guard restored from another's state() decides the next steps as that one would: the same spike limit
// (from the same last 50 losses, in the same order) and the same count of skipped steps in a row.
TEST(RunControl, StateRestoresTheGuardsBookkeeping) {
    RunControl::Limits l;
    l.loss_spike = 2.0f;
    l.max_bad_steps = 3;
    RunControl a(l, std::chrono::steady_clock::now());
    for (int i = 0; i < 57; i++) a.after_step(i + 1, 3.0 + 0.01 * i + 1e-13 * (i % 7), "");
    a.after_step(58, NAN, "a loss is not finite");
    a.after_step(59, NAN, "a loss is not finite");
    const std::vector<uint8_t> blob = a.state();
    EXPECT_EQ(blob.size(), 16u + 8u * 50u);
    RunControl b(l, std::chrono::steady_clock::now());
    EXPECT_TRUE(std::isinf(b.loss_limit()));
    b.restore(blob, "ckpt_00000059");
    EXPECT_EQ(b.loss_limit(), a.loss_limit());  // bitwise: the same losses added in the same order
    EXPECT_EQ(b.state(), blob);
    // Two skipped in a row were carried over: the third ends the run, in both.
    expect_error([&] { b.after_step(60, NAN, "a loss is not finite"); }, kExitDiverged, {"3 steps in a row"});
    expect_error([&] { a.after_step(60, NAN, "a loss is not finite"); }, kExitDiverged, {"3 steps in a row"});
    // A fresh guard's state restores to a fresh guard.
    RunControl fresh(l, std::chrono::steady_clock::now()), c(l, std::chrono::steady_clock::now());
    c.restore(fresh.state(), "ckpt");
    EXPECT_TRUE(std::isinf(c.loss_limit()));
}

TEST(RunControl, StateThatIsNotAGuardsIsRefused) {
    RunControl::Limits l;
    l.loss_spike = 2.0f;
    RunControl a(l, std::chrono::steady_clock::now());
    for (int i = 0; i < 12; i++) a.after_step(i + 1, 2.0, "");
    const std::vector<uint8_t> good = a.state();
    RunControl b(l, std::chrono::steady_clock::now());
    auto refused = [&](std::vector<uint8_t> blob, std::vector<std::string> words) {
        words.push_back("ckpt_00000012");
        expect_error([&] { b.restore(blob, "ckpt_00000012"); }, kExitData, words);
    };
    refused({}, {"magic"});
    std::vector<uint8_t> v = good;
    v[3] ^= 1;  // the magic
    refused(v, {"magic"});
    v = good;
    v.pop_back();  // truncated
    refused(v, {"12 losses", "at most 50"});
    v = good;
    v[12] = 51;  // more losses than the guard keeps (and than the blob holds)
    refused(v, {"51 losses"});
    v = good;
    v[11] = 0x80;  // 2^31 skipped steps in a row
    refused(v, {"skipped steps"});
    v = good;
    for (int i = 0; i < 8; i++) v[16 + i] = 0xff;  // the first loss a NaN
    refused(v, {"not finite", "entry 0"});
    EXPECT_TRUE(std::isinf(b.loss_limit()));  // nothing refused was taken up
    b.restore(good, "ckpt_00000012");
    EXPECT_FLOAT_EQ(b.loss_limit(), 4.0f);  // 2 x the mean of twelve losses of 2
}

TEST(RunControl, TimeLimitKeepsTwoStepsACheckpointAndTheExitInReserve) {
    static_assert(RunControl::kExitReserveSeconds == 1.0, "the sums below assume a 1 s exit reserve");
    RunControl::Limits l;
    l.time_limit_s = 10;
    l.time_limit_text = "10s";
    l.checkpoint_seconds = 3;
    const auto now = std::chrono::steady_clock::now();
    RunControl c(l, now - std::chrono::seconds(4));
    EXPECT_EQ(c.reason(0.9), "");                          // 4 + 1.8 + 3 + 1 < 10
    EXPECT_NE(c.reason(1.1).find("--time-limit 10s"), std::string::npos);  // 4 + 2.2 + 3 + 1 >= 10
    c.saved(1.0);                                          // a measured save replaces the guess
    EXPECT_EQ(c.reason(1.9), "");                          // 4 + 3.8 + 1 + 1 < 10
    EXPECT_NE(c.reason(2.1).find("--time-limit 10s"), std::string::npos);  // 4 + 4.2 + 1 + 1 >= 10
    RunControl none(RunControl::Limits{}, now - std::chrono::hours(100));
    EXPECT_EQ(none.reason(1e6), "");
}

TEST(RunControl, ASignalAsksToStop) {
    install_stop_signals();
    RunControl c(RunControl::Limits{}, std::chrono::steady_clock::now());
    EXPECT_EQ(c.reason(0.1), "");
    std::raise(SIGUSR1);
    EXPECT_NE(c.reason(0.1).find("signal"), std::string::npos);
    g_stop_signal = 0;
    g_stop_signal_ns = 0;
}

// On a clock of the test's own: a stop signal up to 0.5 s after the first is that one again (a launcher
// passing on what the process group got is 10-100 ms behind it); a later one is a second request. The
// window counts from the first signal, not from its repeats.
TEST(RunControl, AStopWithinHalfASecondOfTheFirstIsTheSameOne) {
    const int64_t t = 1'000'000'000'000, ms = 1'000'000;
    EXPECT_TRUE(take_stop_signal(SIGINT, t));
    for (int64_t after : {0, 1, 10, 50, 100, 300, 499}) EXPECT_TRUE(take_stop_signal(SIGTERM, t + after * ms)) << after;
    EXPECT_EQ(g_stop_signal, SIGINT);
    EXPECT_EQ(g_stop_signal_ns.load(), t);
    for (int64_t after : {500, 800, 60'000}) EXPECT_FALSE(take_stop_signal(SIGINT, t + after * ms)) << after;
    g_stop_signal = 0;
    g_stop_signal_ns = 0;
}

// The same with real signals, each in a process of its own: the same stop twice at once and again 50 ms
// later is one request; a second signal later ends the process at once, by that signal.
TEST(RunControlDeathTest, TheSameStopTwiceIsOneRequest) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(
        {
            install_stop_signals();
            std::raise(SIGINT);
            std::raise(SIGTERM);
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            std::raise(SIGINT);
            std::exit(g_stop_signal == SIGINT ? 0 : 1);
        },
        testing::ExitedWithCode(0), "");
}

TEST(RunControlDeathTest, ASecondSignalLaterEndsTheRunAtOnce) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(
        {
            install_stop_signals();
            std::raise(SIGINT);
            std::this_thread::sleep_for(std::chrono::nanoseconds(kStopSignalRepeatNs + 200'000'000));
            std::raise(SIGTERM);
            std::exit(0);  // not reached: SIGTERM's default action ends the process
        },
        testing::KilledBySignal(SIGTERM), "");
}

TEST(RunSettings, RolesDecideWhatIsRecordedRequiredAndHashed) {
    using R = RunSetting;
    const std::vector<R> a = {{"model", "d12", R::MustMatch}, {"lr", "0.001", R::MayChange}, {"val_every", "20", R::Ranks}};
    const auto rec = recorded_settings(a);
    ASSERT_EQ(rec.size(), 2u);
    EXPECT_EQ(rec[0].first, "model");
    EXPECT_EQ(rec[1].first, "lr");
    EXPECT_EQ(must_match_keys(a), std::vector<std::string>{"model"});
    std::vector<R> b = a;
    EXPECT_EQ(settings_hash(a), settings_hash(b));
    for (size_t i = 0; i < a.size(); i++) {  // any value, Ranks ones included, changes the hash
        b = a;
        b[i].value += "0";
        EXPECT_NE(settings_hash(a), settings_hash(b)) << a[i].key;
    }
}
