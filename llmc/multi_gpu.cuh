/*
NCCL for data-parallel training: one MultiGpu object per process owns the communicator, a stream for
communication and the events that order it against the compute stream.

Provides:
- ncclCheck(call): an llmc::Error (kExitCuda) naming the call, the source location, NCCL's error
  text and its last message.
- MultiGpu: picks the GPU (rendezvous.h's device_for_rank: the local rank, or the only visible GPU),
  meets the other ranks (rendezvous.h; rank 0 makes the id with ncclGetUniqueId) and creates the
  communicator non-blocking, polling it against a deadline, so a peer that never comes ends in an
  error, not a hang. One rank goes through NCCL too, so the one-GPU run exercises the same path as the
  many-GPU one.
- Collectives that run on the communication stream after the work the compute stream has queued so
  far ("async"), and join(), which makes the compute stream wait for every one of them: in-place
  all-reduce sums (of one buffer or of several ranges in one group, e.g. one layer's gradient slices
  while backward goes on with the layer below), ZeRO-1's reduce-scatter sum of the gradients into
  this rank's shard and in-place all-gather of the parameters (zero.h's geometry: buffers hold the
  padded total P, the shard is S elements at rank*S), a broadcast, and all-reduce means for fp32
  values such as losses. Gradients are summed, not averaged: NCCL's average multiplies by 1/W, which
  bf16 cannot hold exactly for W = 3, 5, 6, 7, ...; the update divides by W in fp32 instead
  (global_norm.cuh's `ranks`). Types: float and floatX (bf16), int32 and uint64.
- barrier() for the host, and check_same(), which stops every rank when they were started with
  different settings (compare a hash of the flags and the parameter count at start-up).
- A watchdog thread that ends the process with a clear message when NCCL reports an asynchronous
  error (a peer died, the network failed) or when heartbeat() was not called for the hang timeout
  (default kDefaultHangTimeout; a phase may ask for longer); it aborts the communicator first, so no
  GPU kernel spins forever. heartbeat() is cheap and may be called from any thread.
- abort(), for a rank's error path: the communicator is aborted once (idempotent, never throws), so
  NCCL's kernels on this GPU stop and peers connected through the network get an error at once (peers
  on the same node, connected through GPU memory, notice through their own hang timeout). The
  destructor aborts instead of finalizing when an exception unwinds it, and MultiGpuAbortOnError does
  the same for a scope, early in the unwinding.

Does not provide: the choice of which buffers to reduce when (train_gpt2.cu), the sharded AdamW
update, or MPI.
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
    cudaStream_t comm_stream() const { return comm_stream_; }

    // ---- collectives, each queued on the communication stream after the compute stream's work so far ----

    // buf[0, n) becomes the sum over ranks, on every rank (gradients; partial sums of squares for a sharded
    // gradient norm).
    template <class T>
    void all_reduce_sum_async(T* buf, size_t n, cudaStream_t compute) {
        after(compute);
        settle(ncclAllReduce(buf, buf, n, nccl_type<T>(), ncclSum, comm_, comm_stream_), "ncclAllReduce");
    }

    // buf[0, n) becomes the largest over ranks, on every rank (FP8 amaxes, so that every rank scales alike).
    template <class T>
    void all_reduce_max_async(T* buf, size_t n, cudaStream_t compute) {
        after(compute);
        settle(ncclAllReduce(buf, buf, n, nccl_type<T>(), ncclMax, comm_, comm_stream_), "ncclAllReduce");
    }

    // The same over several ranges of one buffer, in one NCCL group (e.g. every gradient slice of one layer).
    template <class T>
    void all_reduce_sum_async(T* buf, const std::vector<ShardRange>& ranges, cudaStream_t compute) {
        all_reduce_ranges(buf, ranges, ncclSum, compute);
    }

    // ZeRO-1: full holds layout.padded_total() elements on every rank; shard (layout.shard_size elements)
    // receives the sum over ranks of full's slice [rank*S, (rank+1)*S). shard may be full + rank*S.
    template <class T>
    void reduce_scatter_sum_async(const T* full, T* shard, const ZeroLayout& layout, cudaStream_t compute) {
        reduce_scatter(full, shard, layout, ncclSum, compute);
    }

    // buf[0, n) becomes the mean over ranks, on every rank: for fp32 values (losses). bf16 gradients are
    // summed instead (see the top of this file).
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

    // ZeRO-1: every rank's slice [r*S, (r+1)*S) of full (its updated parameters) is copied to every rank,
    // in place. Queue it after the update on the compute stream; join() before the next forward.
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

    // Waits (host) until every rank has got here: e.g. all optimizer shards are written before rank 0
    // marks a checkpoint complete.
    void barrier() {
        require_live();
        uint64_t* d = scratch_.get();
        settle(ncclAllReduce(d, d, 1, ncclUint64, ncclSum, comm_, comm_stream_), "ncclAllReduce (barrier)");
        cudaCheck(cudaStreamSynchronize(comm_stream_));
    }

    // Fails on every rank unless all ranks pass the same value (a hash of the flags, the parameter count):
    // ranks started with different settings would otherwise train on silently, or hang.
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

    // Whether `mine` holds on any rank (a vote through one small all-reduce; it synchronises): for decisions
    // the ranks must take together, e.g. stopping after this step or skipping a checkpoint one rank cannot
    // read. Queued after the work already on `compute`.
    bool any(bool mine, cudaStream_t compute) {
        after(compute);
        return any(mine);
    }
    // The same vote on the host's say alone, ordered after no compute work (it synchronises too): e.g.
    // whether rank 0 could prepare the directory every rank is about to write a checkpoint into.
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

    // Tells the watchdog this rank is making progress: call it once per step and in every phase that
    // runs without steps (evaluation, sampling, a checkpoint's save or load). A few atomic stores, safe
    // from any thread: a thread that loads a checkpoint can beat once per chunk. `phase`, when given,
    // names what the rank is doing in the hang message; it must be a string literal (it is kept by
    // pointer). `allow_s` > 0 lets the time until the next heartbeat run to that many seconds even when
    // that is longer than the hang timeout (a phase known to be long and impossible to beat from); the
    // next heartbeat without it ends the allowance.
    void heartbeat(const char* phase = nullptr, double allow_s = 0) noexcept {
        if (phase != nullptr) phase_.store(phase, std::memory_order_relaxed);
        allow_ns_.store(allow_s > 0 ? int64_t(allow_s * 1e9) : 0, std::memory_order_relaxed);
        last_beat_ns_.store(now_ns(), std::memory_order_release);
    }

    double hang_timeout_s() const { return options_.hang_timeout_s; }

    // For a rank that cannot go on (a bad input file, a failed write, out of memory): aborts the
    // communicator once, so that NCCL's kernels on this GPU stop and peers connected through the network
    // get an error within seconds instead of waiting in their next collective forever. Idempotent and
    // never throws; `why` goes into the one line it prints to stderr. Afterwards every collective raises
    // an error and the destructor does nothing more. Call it from the thread that issues collectives
    // (or once no other thread issues any).
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

    // Polls a non-blocking communicator until its last call has been taken in: ncclSuccess, the error it
    // ended in, or ncclInProgress when the deadline came first. Never throws (the destructor uses it).
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

    // A call on a non-blocking communicator may return ncclInProgress (connections being set up): it is
    // complete once the communicator is idle again.
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

// Aborts the communicator (MultiGpu::abort) when an exception unwinds the scope it lives in. Declare it
// after the objects whose destructors may wait for the GPU (device buffers, streams, a checkpoint
// writer): it is destroyed before them, so a rank that fails while NCCL kernels wait for its peers
// does not hang in those destructors, and the peers hear of it as early as possible.
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
