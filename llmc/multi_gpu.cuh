/*
NCCL for data-parallel training: one MultiGpu per process owns the communicator, a communication stream
and the events that order it against the compute stream.
- ncclCheck(call): an llmc::Error (kExitCuda) naming the call, location, NCCL's error and last message.
- MultiGpu: picks the GPU, meets the other ranks (rendezvous.h) and creates the communicator
  non-blocking against a deadline (one rank goes through NCCL too). Collectives run on the
  communication stream after the compute stream's queued work; join() makes compute wait for them.
  Gradients are summed, not averaged (1/W is not exact in bf16); the update divides by W in fp32.
- barrier(), check_same() (ranks started with different settings stop), any() (a vote).
- A watchdog thread ends the process with a clear message on an asynchronous NCCL error or when
  heartbeat() was not called for the hang timeout, aborting the communicator first.
- abort() for a rank's error path (idempotent, never throws); MultiGpuAbortOnError for a scope.
*/
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include "llmc/cuda_utils.cuh"
#include "llmc/rendezvous.h"
#include "llmc/utils.h"
#include "llmc/zero.h"

namespace llmc {

static_assert(sizeof(ncclUniqueId) == kUniqueIdBytes, "rendezvous.h's UniqueId must hold NCCL's unique id");

inline void nccl_check(ncclResult_t r, const char* call, const char* file, int line) {
    if (r != ncclSuccess && r != ncclInProgress) {
        const char* last = ncclGetLastError(nullptr);
        fail(kExitCuda, "NCCL error %d (%s) from %s at %s:%d%s%s", int(r), ncclGetErrorString(r), call, file, line,
             last != nullptr && *last ? ": " : "", last != nullptr ? last : "");
    }
}

#define ncclCheck(call) ::llmc::nccl_check((call), #call, __FILE__, __LINE__)

template <class T>
constexpr ncclDataType_t nccl_type() {
    static_assert(std::is_same<T, float>::value || std::is_same<T, __nv_bfloat16>::value ||
                      std::is_same<T, int32_t>::value || std::is_same<T, uint64_t>::value,
                  "MultiGpu collectives take float, bf16, int32 or uint64 buffers");
    return std::is_same<T, float>::value     ? ncclFloat32
           : std::is_same<T, int32_t>::value ? ncclInt32
           : std::is_same<T, uint64_t>::value ? ncclUint64
                                              : ncclBfloat16;
}

inline UniqueId new_unique_id() {
    ncclUniqueId nid;
    ncclCheck(ncclGetUniqueId(&nid));
    UniqueId id;
    std::memcpy(id.data(), &nid, kUniqueIdBytes);
    return id;
}

struct MultiGpuOptions {
    std::string rendezvous;                            // the --rendezvous value ("" = the default for the ranks)
    double init_timeout_s = kDefaultRendezvousTimeout;  // rendezvous and communicator set-up
    double hang_timeout_s = kDefaultHangTimeout;        // no heartbeat() for this long ends the run; 0: never
};

class MultiGpu {
public:
    MultiGpu(const RankInfo& ranks, const MultiGpuOptions& options)
        : ranks_(ranks), options_(options), device_(select_device(ranks)) {
        const RendezvousSpec spec = resolve_rendezvous(options.rendezvous, ranks);
        const UniqueId id = exchange_unique_id(spec, ranks, new_unique_id, options.init_timeout_s);
        ncclUniqueId nid;
        std::memcpy(&nid, id.data(), kUniqueIdBytes);
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        const auto t0 = std::chrono::steady_clock::now();
        ncclCheck(ncclCommInitRankConfig(&comm_, ranks.world, nid, ranks.rank, &config));
        const ncclResult_t state = poll_state(options.init_timeout_s);
        if (state != ncclSuccess) {
            ncclCommAbort(std::exchange(comm_, nullptr));
            nccl_check(state, "ncclCommInitRankConfig (asynchronous part)", __FILE__, __LINE__);
            fail(kExitCuda,
                 "NCCL: rank %d of %d could not set up the communicator within %.0f s (rendezvous %s): a peer did "
                 "not come, or the nodes cannot reach each other (NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO tell more)",
                 ranks.rank, ranks.world, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 spec.text().c_str());
        }
        scratch_.allocate(2);
        last_beat_ns_ = now_ns();
        watchdog_ = std::thread([this] { watch(); });
    }
    MultiGpu(const MultiGpu&) = delete;
    MultiGpu& operator=(const MultiGpu&) = delete;

    ~MultiGpu() {
        if (std::uncaught_exceptions() > uncaught_at_start_) abort("an error ends this rank");
        stop_watchdog();
        if (comm_ == nullptr || aborted_.load()) return;
        // Finalize flushes outstanding work; if it does not settle (a peer is gone), abort instead of hanging.
        const ncclResult_t r = ncclCommFinalize(comm_);
        const bool clean = (r == ncclSuccess || r == ncclInProgress) && poll_state(10.0) == ncclSuccess;
        if (clean) ncclCommDestroy(comm_);
        else ncclCommAbort(comm_);
    }

    int device() const { return device_; }
    int rank() const { return ranks_.rank; }
    int world() const { return ranks_.world; }
    int local_rank() const { return ranks_.local_rank; }
    bool is_root() const { return ranks_.rank == 0; }
    const RankInfo& ranks() const { return ranks_; }

    // ---- collectives, each queued on the communication stream after the compute stream's work so far ----

    // buf[0, n) becomes the sum over ranks, on every rank.
    template <class T>
    void all_reduce_sum_async(T* buf, size_t n, cudaStream_t compute) {
        after(compute);
        settle(ncclAllReduce(buf, buf, n, nccl_type<T>(), ncclSum, comm_, comm_stream_), "ncclAllReduce");
    }

    // The same over several ranges of one buffer, in one NCCL group (e.g. every gradient slice of one layer).
    template <class T>
    void all_reduce_sum_async(T* buf, const std::vector<ShardRange>& ranges, cudaStream_t compute) {
        all_reduce_ranges(buf, ranges, ncclSum, compute);
    }

    // ZeRO-1: full holds layout.padded_total() elements; shard (S elements) receives the sum over ranks of
    // full's slice [rank*S, (rank+1)*S). shard may be full + rank*S.
    template <class T>
    void reduce_scatter_sum_async(const T* full, T* shard, const ZeroLayout& layout, cudaStream_t compute) {
        reduce_scatter(full, shard, layout, ncclSum, compute);
    }

    // buf[0, n) becomes the mean over ranks, on every rank (fp32 values such as losses).
    template <class T>
    void all_reduce_mean_async(T* buf, size_t n, cudaStream_t compute) {
        after(compute);
        settle(ncclAllReduce(buf, buf, n, nccl_type<T>(), ncclAvg, comm_, comm_stream_), "ncclAllReduce");
    }

    // The mean over several ranges, and ZeRO-1's reduce-scatter mean: as the sums above, with NCCL's average.
    template <class T>
    void all_reduce_mean_async(T* buf, const std::vector<ShardRange>& ranges, cudaStream_t compute) {
        all_reduce_ranges(buf, ranges, ncclAvg, compute);
    }
    template <class T>
    void reduce_scatter_mean_async(const T* full, T* shard, const ZeroLayout& layout, cudaStream_t compute) {
        reduce_scatter(full, shard, layout, ncclAvg, compute);
    }

    // ZeRO-1: every rank's slice [r*S, (r+1)*S) of full is copied to every rank, in place. join() before
    // the next forward.
    template <class T>
    void all_gather_async(T* full, const ZeroLayout& layout, cudaStream_t compute) {
        check_layout(layout);
        after(compute);
        const T* mine = full + int64_t(rank()) * layout.shard_size;
        settle(ncclAllGather(mine, full, size_t(layout.shard_size), nccl_type<T>(), comm_, comm_stream_),
               "ncclAllGather");
    }

    // buf[0, n) on every rank becomes rank root's (e.g. the step a resume starts from, chosen by rank 0).
    template <class T>
    void broadcast_async(T* buf, size_t n, int root, cudaStream_t compute) {
        after(compute);
        settle(ncclBroadcast(buf, buf, n, nccl_type<T>(), root, comm_, comm_stream_), "ncclBroadcast");
    }

    // Waits (host) until every rank has got here.
    void barrier() {
        require_live();
        uint64_t* d = scratch_.get();
        settle(ncclAllReduce(d, d, 1, ncclUint64, ncclSum, comm_, comm_stream_), "ncclAllReduce (barrier)");
        cudaCheck(cudaStreamSynchronize(comm_stream_));
    }

    // Fails on every rank unless all ranks pass the same value (a hash of the flags, the parameter count).
    void check_same(uint64_t value, const char* what) {
        require_live();
        const uint64_t host[2] = {value, value};
        uint64_t* d = scratch_.get();
        cudaCheck(cudaMemcpyAsync(d, host, sizeof(host), cudaMemcpyHostToDevice, comm_stream_));
        settle(ncclGroupStart(), "ncclGroupStart");
        settle(ncclAllReduce(d, d, 1, ncclUint64, ncclMin, comm_, comm_stream_), "ncclAllReduce (min)");
        settle(ncclAllReduce(d + 1, d + 1, 1, ncclUint64, ncclMax, comm_, comm_stream_), "ncclAllReduce (max)");
        settle(ncclGroupEnd(), "ncclGroupEnd");
        uint64_t got[2] = {0, 0};
        cudaCheck(cudaMemcpyAsync(got, d, sizeof(got), cudaMemcpyDeviceToHost, comm_stream_));
        cudaCheck(cudaStreamSynchronize(comm_stream_));
        if (got[0] != got[1]) {
            fail(kExitUsage, "the %d ranks disagree on %s (this rank: %llu; values from %llu to %llu): start every rank "
                             "with the same flags and files", world(), what, (unsigned long long)value,
                 (unsigned long long)got[0], (unsigned long long)got[1]);
        }
    }

    // Whether `mine` holds on any rank (one small all-reduce; it synchronises), queued after the work on
    // `compute`: for decisions the ranks must take together.
    bool any(bool mine, cudaStream_t compute) {
        after(compute);
        return any(mine);
    }
    // The same vote on the host's say alone, ordered after no compute work (it synchronises too).
    bool any(bool mine) {
        require_live();
        const uint64_t vote = mine ? 1 : 0;
        uint64_t* d = scratch_.get();
        cudaCheck(cudaMemcpyAsync(d, &vote, sizeof(vote), cudaMemcpyHostToDevice, comm_stream_));
        settle(ncclAllReduce(d, d, 1, ncclUint64, ncclMax, comm_, comm_stream_), "ncclAllReduce (max)");
        uint64_t got = 0;
        cudaCheck(cudaMemcpyAsync(&got, d, sizeof(got), cudaMemcpyDeviceToHost, comm_stream_));
        cudaCheck(cudaStreamSynchronize(comm_stream_));
        return got != 0;
    }

    // The compute stream waits for every collective queued so far.
    void join(cudaStream_t compute) {
        cudaCheck(cudaEventRecord(comm_done_, comm_stream_));
        cudaCheck(cudaStreamWaitEvent(compute, comm_done_, 0));
    }

    // Tells the watchdog this rank is making progress: once per step and in every phase without steps.
    // Safe from any thread. `phase` (a string literal, kept by pointer) names the phase in the hang
    // message; `allow_s` > 0 lets the next heartbeat come that many seconds later, past the hang timeout.
    void heartbeat(const char* phase = nullptr, double allow_s = 0) noexcept {
        if (phase != nullptr) phase_.store(phase, std::memory_order_relaxed);
        allow_ns_.store(allow_s > 0 ? int64_t(allow_s * 1e9) : 0, std::memory_order_relaxed);
        last_beat_ns_.store(now_ns(), std::memory_order_release);
    }

    double hang_timeout_s() const { return options_.hang_timeout_s; }

    // For a rank that cannot go on: aborts the communicator once, so NCCL's kernels stop and networked
    // peers get an error at once. Idempotent, never throws; `why` goes into its one line on stderr.
    // Afterwards every collective raises. Call it from the thread that issues collectives.
    void abort(const char* why = nullptr) noexcept {
        if (aborted_.exchange(true)) return;
        stop_watchdog();
        std::fprintf(stderr, "rank %d of %d: %s; aborting the NCCL communicator so the other ranks stop too\n",
                     ranks_.rank, ranks_.world, why != nullptr ? why : "stopping after an error");
        std::fflush(stderr);
        if (comm_ != nullptr) ncclCommAbort(comm_);
    }
    bool aborted() const { return aborted_.load(); }

private:
    static int64_t now_ns() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
    }

    void require_live() const {
        if (aborted_.load()) {
            fail(kExitCuda, "rank %d of %d: the NCCL communicator was aborted after an error; no collective can run",
                 rank(), world());
        }
    }

    void after(cudaStream_t compute) {
        require_live();
        cudaCheck(cudaEventRecord(compute_done_, compute));
        cudaCheck(cudaStreamWaitEvent(comm_stream_, compute_done_, 0));
    }

    template <class T>
    void all_reduce_ranges(T* buf, const std::vector<ShardRange>& ranges, ncclRedOp_t op, cudaStream_t compute) {
        after(compute);
        settle(ncclGroupStart(), "ncclGroupStart");
        for (const ShardRange& r : ranges) {
            if (r.empty()) continue;
            settle(ncclAllReduce(buf + r.begin, buf + r.begin, size_t(r.size()), nccl_type<T>(), op, comm_,
                                 comm_stream_),
                   "ncclAllReduce");
        }
        settle(ncclGroupEnd(), "ncclGroupEnd");
    }

    template <class T>
    void reduce_scatter(const T* full, T* shard, const ZeroLayout& layout, ncclRedOp_t op, cudaStream_t compute) {
        check_layout(layout);
        after(compute);
        settle(ncclReduceScatter(full, shard, size_t(layout.shard_size), nccl_type<T>(), op, comm_, comm_stream_),
               "ncclReduceScatter");
    }

    void check_layout(const ZeroLayout& layout) const {
        if (layout.world != world()) {
            fail(kExitError, "MultiGpu: a ZeRO layout for %d ranks used with %d", layout.world, world());
        }
    }

    // The GPU is chosen before any member that belongs to a device (the stream, the events) is made.
    static int select_device(const RankInfo& ranks) {
        const int device = device_for_rank(ranks, cuda_device_count());
        cudaCheck(cudaSetDevice(device));
        return device;
    }

    // Polls a non-blocking communicator until its last call is taken in (or the deadline). Never throws.
    ncclResult_t poll_state(double timeout_s) noexcept {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(int64_t(timeout_s * 1e6));
        for (;;) {
            ncclResult_t state = ncclSuccess;
            const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
            if (r != ncclSuccess) return r;
            if (state != ncclInProgress) return state;
            if (std::chrono::steady_clock::now() >= deadline) return ncclInProgress;
            std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
    }

    // A call on a non-blocking communicator may return ncclInProgress: complete once it is idle again.
    void settle(ncclResult_t r, const char* call) {
        nccl_check(r, call, __FILE__, __LINE__);
        if (r != ncclInProgress) return;
        const ncclResult_t state = poll_state(options_.init_timeout_s);
        nccl_check(state == ncclInProgress ? ncclSuccess : state, call, __FILE__, __LINE__);
        if (state == ncclInProgress) {
            fail(kExitCuda, "NCCL: %s on rank %d of %d did not start within %.0f s: a peer is not responding", call,
                 rank(), world(), options_.init_timeout_s);
        }
    }

    // Stops the watchdog and waits for it, except from the watchdog itself. Never throws.
    void stop_watchdog() noexcept {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        wake_.notify_all();
        if (watchdog_.joinable() && watchdog_.get_id() != std::this_thread::get_id()) {
            try {
                watchdog_.join();
            } catch (const std::exception&) {
            }
        }
    }

    [[noreturn]] void die(const std::string& why) {
        std::fprintf(stderr, "error: rank %d of %d: %s; aborting the NCCL communicator\n", rank(), world(), why.c_str());
        std::fflush(stderr);
        if (!aborted_.exchange(true)) ncclCommAbort(comm_);
        std::_Exit(kExitCuda);
    }

    void watch() {
        std::unique_lock<std::mutex> lock(mutex_);
        while (!wake_.wait_for(lock, std::chrono::milliseconds(500), [this] { return stop_; })) {
            ncclResult_t state = ncclSuccess;
            if (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
                state != ncclInProgress) {
                die(format("NCCL reported %s (a peer may have died or the network failed)", ncclGetErrorString(state)));
            }
            if (options_.hang_timeout_s <= 0) continue;
            const double idle = double(now_ns() - last_beat_ns_.load(std::memory_order_acquire)) * 1e-9;
            const double allowed = std::max(options_.hang_timeout_s, double(allow_ns_.load()) * 1e-9);
            if (idle > allowed) {
                die(format("no progress for %.0f s while %s (allowed: %.0f s; --hang-timeout sets it): a peer is "
                           "probably stuck or gone",
                           idle, phase_.load(), allowed));
            }
        }
    }

    RankInfo ranks_;
    MultiGpuOptions options_;
    int device_ = 0;
    ncclComm_t comm_ = nullptr;
    Stream comm_stream_;
    Event compute_done_, comm_done_;
    DeviceBuffer<uint64_t> scratch_;
    std::atomic<int64_t> last_beat_ns_{0};
    std::atomic<int64_t> allow_ns_{0};
    std::atomic<const char*> phase_{"starting"};
    std::atomic<bool> aborted_{false};
    const int uncaught_at_start_ = std::uncaught_exceptions();
    std::thread watchdog_;
    std::mutex mutex_;
    std::condition_variable wake_;
    bool stop_ = false;
};

// Aborts the communicator when an exception unwinds its scope. Declare it after the objects whose
// destructors may wait for the GPU, so it runs before them and no rank hangs there.
class MultiGpuAbortOnError {
public:
    explicit MultiGpuAbortOnError(MultiGpu* multi) noexcept : multi_(multi) {}
    ~MultiGpuAbortOnError() {
        if (multi_ != nullptr && std::uncaught_exceptions() > uncaught_at_start_) {
            multi_->abort("an error ends this rank");
        }
    }
    MultiGpuAbortOnError(const MultiGpuAbortOnError&) = delete;
    MultiGpuAbortOnError& operator=(const MultiGpuAbortOnError&) = delete;

private:
    MultiGpu* multi_;
    const int uncaught_at_start_ = std::uncaught_exceptions();
};

}  // namespace llmc
