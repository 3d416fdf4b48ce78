/*
When a training run stops early, decided on the host after each step, shared by the trainers:
- the step guard's bookkeeping: --max-bad-steps skipped updates in a row end the run (kExitDiverged);
  the spike limit is --loss-spike times the mean loss of the last applied steps; checkpointed;
- a stop request: SIGTERM, SIGINT or SIGUSR1 (a second one ends the process at once), or --time-limit
  within reach: the trainer checkpoints and exits with kExitStopped, for a job script to requeue;
- parse_duration(): "3600", "90m", "23.5h", "1:30:00" -> seconds.
*/
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <deque>
#include <numeric>
#include <string>
#include <vector>

#include <signal.h>
#include <time.h>

#include "llmc/run_log.h"
#include "llmc/utils.h"

namespace llmc {

// "3600", "90m", "23.5h", "1:30:00" (or "30:00") -> seconds; "" -> 0 (none). flag names it in errors.
// Only digits, a decimal point and the unit letters are taken; anything else is refused, not guessed.
inline double parse_duration(const std::string& text, const char* flag) {
    if (text.empty()) return 0;
    auto digit = [](char c) { return c >= '0' && c <= '9'; };
    double seconds = 0;
    const char* p = text.c_str();
    char* end = nullptr;
    if (text.find(':') != std::string::npos) {
        // Up to three fields of digits, every ':' followed by the next one.
        for (int field = 0; field < 3 && digit(*p); field++) {
            seconds = seconds * 60 + double(std::strtol(p, &end, 10));
            p = end;
            if (*p != ':' || !digit(p[1])) break;
            p++;
        }
    } else if (digit(*p) || *p == '.') {
        const char* number_end = p + std::min(text.size(), text.find_first_not_of("0123456789."));
        seconds = std::strtod(p, &end);
        if (end == number_end) {
            p = end + (*end == 'h' || *end == 'm' || *end == 's');
            seconds *= *end == 'h' ? 3600 : *end == 'm' ? 60 : 1;
        }
    }
    if (*p != '\0' || !(seconds > 0) || !std::isfinite(seconds)) {
        fail(kExitUsage, "%s '%s': expected seconds, a number with a unit (90m, 23.5h) or H:MM:SS", flag, text.c_str());
    }
    return seconds;
}

inline volatile std::sig_atomic_t g_stop_signal = 0;

// A stop signal within this long of the first is the same request delivered twice (process group and
// launcher), not a second one.
constexpr int64_t kStopSignalRepeatNs = 500'000'000;

// CLOCK_MONOTONIC in ns when the first stop signal came (0: none yet); lock-free, so a handler may use it.
inline std::atomic<int64_t> g_stop_signal_ns{0};
static_assert(std::atomic<int64_t>::is_always_lock_free, "the stop signal's time must be usable in a handler");

// Takes up a stop signal that came at now_ns (CLOCK_MONOTONIC): the first is recorded, a repeat within
// kStopSignalRepeatNs changes nothing, a second request gives false. now_ns is a parameter for tests.
inline bool take_stop_signal(int sig, int64_t now_ns) {
    if (g_stop_signal != 0) return now_ns - g_stop_signal_ns.load() < kStopSignalRepeatNs;
    g_stop_signal_ns.store(now_ns);
    g_stop_signal = sig;
    return true;
}

extern "C" inline void llmc_on_stop_signal(int sig) {
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
    if (take_stop_signal(sig, int64_t(now.tv_sec) * 1'000'000'000 + now.tv_nsec)) return;
    std::signal(sig, SIG_DFL);  // a second request ends the run at once
    std::raise(sig);
}

inline void install_stop_signals() {
    struct sigaction sa = {};
    sa.sa_handler = llmc_on_stop_signal;
    sigemptyset(&sa.sa_mask);  // the stop signals wait for each other's handler
    for (int sig : {SIGTERM, SIGINT, SIGUSR1}) sigaddset(&sa.sa_mask, sig);
    sa.sa_flags = SA_RESTART;
    for (int sig : {SIGTERM, SIGINT, SIGUSR1}) {
        if (sigaction(sig, &sa, nullptr) != 0) fail(kExitError, "cannot install the handler of signal %d", sig);
    }
}

class RunControl {
public:
    struct Limits {
        int max_bad_steps = 8;
        float loss_spike = 0.0f;      // 0: off
        double time_limit_s = 0;      // 0: none
        std::string time_limit_text;  // as given, for the message
        double checkpoint_seconds = 0;  // a guess of one save's time until one has been measured
        bool checkpoints = true;        // whether the run writes checkpoints (-y 1 can resume it)
    };
    // started: when the process started (--time-limit counts from there, as a scheduler does).
    RunControl(Limits limits, std::chrono::steady_clock::time_point started)
        : lim_(std::move(limits)), t0_(started), save_s_(lim_.checkpoint_seconds) {}

    // The step guard's spike limit for the next step (infinity until 10 steps were applied).
    float loss_limit() const {
        if (lim_.loss_spike == 0.0f || recent_.size() < 10) return INFINITY;
        return float(double(lim_.loss_spike) * std::accumulate(recent_.begin(), recent_.end(), 0.0) /
                     double(recent_.size()));
    }
    // After step `step` (from 1) with mean loss `loss`; `skipped` says why the guard skipped its update
    // ("" when it was applied). Too many skipped in a row end the run.
    void after_step(int step, double loss, const std::string& skipped) {
        if (skipped.empty()) {
            bad_run_ = 0;
            recent_.push_back(loss);
            if (recent_.size() > size_t(kRecent)) recent_.pop_front();
            return;
        }
        if (++bad_run_ >= lim_.max_bad_steps) {
            fail(kExitDiverged,
                 "step %d: %d steps in a row were skipped (the last because %s); stopping. The model is as it was "
                 "before them%s a lower learning rate, a longer warmup or a smaller --grad-clip", step, bad_run_,
                 skipped.c_str(),
                 lim_.checkpoints ? ", and so is every checkpoint written since: resume with -y 1 and"
                                  : ", and no model file was written: run again with");
        }
    }
    // The guard's bookkeeping for a checkpoint, little-endian: "llmcGRD1", skipped-in-a-row (u32), the
    // number of losses (u32, at most kRecent) and the losses (fp64 bits, oldest first).
    std::vector<uint8_t> state() const {
        std::vector<uint8_t> out(kStateMagic, kStateMagic + 8);
        auto put = [&out](uint64_t v, int bytes) {
            for (int i = 0; i < bytes; i++) out.push_back(uint8_t(v >> (8 * i)));
        };
        put(uint64_t(bad_run_), 4);
        put(uint64_t(recent_.size()), 4);
        for (double l : recent_) {
            uint64_t bits;
            std::memcpy(&bits, &l, 8);
            put(bits, 8);
        }
        return out;
    }
    // Takes up what state() wrote (where: for errors); anything else is refused (kExitData), guard unchanged.
    void restore(const std::vector<uint8_t>& blob, const std::string& where) {
        auto get = [&blob](size_t at, int bytes) {
            uint64_t v = 0;
            for (int i = 0; i < bytes; i++) v |= uint64_t(blob[at + size_t(i)]) << (8 * i);
            return v;
        };
        if (blob.size() < 16 || std::memcmp(blob.data(), kStateMagic, 8) != 0) {
            fail(kExitData, "%s: the step guard's state (%zu bytes) does not start with its magic", where.c_str(),
                 blob.size());
        }
        const uint64_t bad = get(8, 4), n = get(12, 4);
        if (bad > uint64_t(INT32_MAX)) {
            fail(kExitData, "%s: the step guard's state records %llu skipped steps in a row", where.c_str(),
                 (unsigned long long)bad);
        }
        if (n > kRecent || blob.size() != 16 + 8 * n) {
            fail(kExitData, "%s: the step guard's state records %llu losses in %zu bytes; expected at most %d, in 16 + "
                 "8 each", where.c_str(), (unsigned long long)n, blob.size(), kRecent);
        }
        std::deque<double> recent;
        for (uint64_t i = 0; i < n; i++) {
            const uint64_t bits = get(16 + 8 * size_t(i), 8);
            double l;
            std::memcpy(&l, &bits, 8);
            if (!std::isfinite(l)) {
                fail(kExitData, "%s: the step guard's state holds a loss that is not finite (%g, entry %llu)",
                     where.c_str(), l, (unsigned long long)i);
            }
            recent.push_back(l);
        }
        bad_run_ = int(bad);
        recent_ = std::move(recent);
    }
    // A checkpoint took this long: the time limit keeps that much in reserve.
    void saved(double seconds) { save_s_ = seconds; }
    // What --time-limit keeps for the process's own end after the last checkpoint.
    static constexpr double kExitReserveSeconds = 1.0;
    // Why this process wants to stop now ("" to go on): a signal, or --time-limit within two steps, one
    // checkpoint and kExitReserveSeconds of its end.
    std::string reason(double step_seconds) const {
        if (g_stop_signal != 0) return format("signal %s", strsignal(g_stop_signal));
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
        if (lim_.time_limit_s > 0 && elapsed + 2 * step_seconds + save_s_ + kExitReserveSeconds >= lim_.time_limit_s) {
            return format("--time-limit %s is near (%s elapsed)", lim_.time_limit_text.c_str(),
                          duration_text(elapsed).c_str());
        }
        return "";
    }

private:
    static constexpr int kRecent = 50;  // the applied steps whose mean loss sets the spike limit
    static constexpr char kStateMagic[8] = {'l', 'l', 'm', 'c', 'G', 'R', 'D', '1'};
    Limits lim_;
    std::chrono::steady_clock::time_point t0_;
    double save_s_;
    int bad_run_ = 0;
    std::deque<double> recent_;
};

}  // namespace llmc
