/*
GPU tests of llmc/multi_gpu.cuh.

With one rank through NCCL (the one-GPU path of the trainer): the all-reduce sum and mean of fp32 and
bf16 buffers, whole and by ranges, ZeRO-1's reduce-scatter (sum and mean) and in-place all-gather over
zero.h's padded geometry, and the event ordering between the compute stream and the communication
stream (a collective must see what a slow kernel queued before it wrote). With one rank a sum or a mean
is the identity, so every result must equal its input bit for bit; receive buffers are poisoned first.
Also: the GPU a rank picks (the only visible one, whatever its local rank); global_norm() of gradients
summed over W ranks (the norm of their mean, the update's scale divided by W, today's bits for W = 1);
abort() (idempotent, later collectives refused, the destructor aborts when an exception unwinds it);
the hang watchdog (a heartbeat's allowance, the phase named in the message; death tests).

With two or more GPUs (skipped with a message otherwise): real processes (this binary started again
with a role in its environment) meet through the file rendezvous and run every collective on
rank-dependent inputs (rank r contributes r+1, so a mean must be (W+1)/2 and a sum W(W+1)/2), check
that rank-dependent settings are refused on every rank, and that a rank which aborts makes its peer,
waiting in a collective, end with an error within its hang timeout instead of hanging.
Skipped without a GPU.
*/
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <sstream>
#include <thread>
#include <vector>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "llmc/cuda_common.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/multi_gpu.cuh"
#include "test/gpu_test.h"
#include "test/test_util.h"

using namespace llmc;

namespace {

std::vector<float> random_floats(size_t n, uint64_t seed) {
    SplitMix64 rng(seed);
    std::vector<float> v(n);
    for (float& x : v) x = float(int64_t(rng.below(2000001)) - 1000000) * 1.37e-4f;
    return v;
}

template <class T>
std::vector<T> to_host(const DeviceBuffer<T>& d) {
    std::vector<T> h(d.size());
    cudaCheck(cudaMemcpy(h.data(), d.get(), d.bytes(), cudaMemcpyDeviceToHost));
    return h;
}

template <class T>
void upload(DeviceBuffer<T>& d, const std::vector<T>& h) {
    ASSERT_EQ(d.size(), h.size());
    cudaCheck(cudaMemcpy(d.get(), h.data(), d.bytes(), cudaMemcpyHostToDevice));
    // A copy from pageable memory may still be in flight when cudaMemcpy returns, and the collectives run on
    // non-blocking streams, which do not wait for the legacy stream's work: wait for it here.
    cudaCheck(cudaDeviceSynchronize());
}

// Bitwise equality, naming the count of elements that differ and the first few (index, both values and
// their bits) when they do.
template <class T>
::testing::AssertionResult bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
    if (a.size() != b.size()) {
        return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " and " << b.size();
    }
    size_t differ = 0;
    std::ostringstream first;
    for (size_t i = 0; i < a.size(); i++) {
        if (std::memcmp(&a[i], &b[i], sizeof(T)) == 0) continue;
        if (differ++ < 5) {
            uint32_t ba = 0, bb = 0;
            std::memcpy(&ba, &a[i], sizeof(T));
            std::memcpy(&bb, &b[i], sizeof(T));
            first << " [" << i << "] " << float(a[i]) << " (0x" << std::hex << ba << ") vs " << float(b[i]) << " (0x"
                  << bb << std::dec << ")";
        }
    }
    if (differ == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << differ << " of " << a.size() << " elements differ:" << first.str();
}

// Spins for about `cycles` clock ticks, then writes value into x[0, n): a producer the communication
// stream must wait for.
__global__ void slow_fill(float* x, int64_t n, float value, long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        x[i] = value + float(i % 1000);
    }
}

class MultiGpuTest : public GpuTest {
protected:
    void SetUp() override {
        GpuTest::SetUp();
        if (IsSkipped()) return;
        mg_ = std::make_unique<MultiGpu>(RankInfo{}, MultiGpuOptions{});
        stream_ = std::make_unique<Stream>();  // after the MultiGpu has chosen the device
        compute_ = stream_->get();
    }
    std::unique_ptr<MultiGpu> mg_;
    std::unique_ptr<Stream> stream_;
    cudaStream_t compute_ = nullptr;
};

}  // namespace

TEST_F(MultiGpuTest, OneRankContext) {
    EXPECT_EQ(mg_->rank(), 0);
    EXPECT_EQ(mg_->world(), 1);
    EXPECT_TRUE(mg_->is_root());
    EXPECT_EQ(mg_->device(), 0);
    int current = -1;
    cudaCheck(cudaGetDevice(&current));
    EXPECT_EQ(current, 0);
}

TEST_F(MultiGpuTest, AllReduceMeanFp32AndBf16) {
    for (size_t n : {size_t(1), size_t(7), size_t(1000003)}) {
        const std::vector<float> h = random_floats(n, n);
        DeviceBuffer<float> d(n);
        upload(d, h);
        mg_->all_reduce_mean_async(d.get(), n, compute_);
        mg_->all_reduce_sum_async(d.get(), n, compute_);
        mg_->join(compute_);
        cudaCheck(cudaStreamSynchronize(compute_));
        EXPECT_TRUE(bitwise_equal(to_host(d), h)) << "n=" << n;

        std::vector<floatX> hb(n);
        for (size_t i = 0; i < n; i++) hb[i] = __float2bfloat16(h[i]);
        DeviceBuffer<floatX> db(n);
        upload(db, hb);
        mg_->all_reduce_mean_async(db.get(), n, compute_);
        mg_->all_reduce_sum_async(db.get(), n, compute_);
        mg_->join(compute_);
        cudaCheck(cudaStreamSynchronize(compute_));
        EXPECT_TRUE(bitwise_equal(to_host(db), hb)) << "n=" << n;
    }
}

TEST_F(MultiGpuTest, AllReduceRangesTouchOnlyTheirRanges) {
    const size_t n = 100003;
    const std::vector<float> h = random_floats(n, 11);
    DeviceBuffer<float> d(n);
    upload(d, h);
    const std::vector<ShardRange> ranges = {{0, 17}, {17, 17}, {500, 9001}, {n - 3, int64_t(n)}};
    mg_->all_reduce_mean_async(d.get(), ranges, compute_);
    mg_->join(compute_);
    cudaCheck(cudaStreamSynchronize(compute_));
    EXPECT_TRUE(bitwise_equal(to_host(d), h));
    std::vector<floatX> hb(n);
    for (size_t i = 0; i < n; i++) hb[i] = __float2bfloat16(h[i]);
    DeviceBuffer<floatX> db(n);
    upload(db, hb);
    mg_->all_reduce_sum_async(db.get(), ranges, compute_);
    mg_->join(compute_);
    cudaCheck(cudaStreamSynchronize(compute_));
    EXPECT_TRUE(bitwise_equal(to_host(db), hb));
}

TEST_F(MultiGpuTest, ZeroReduceScatterAllGatherRoundTrip) {
    for (int64_t n : {int64_t(1), int64_t(129), int64_t(124439)}) {
        const ZeroLayout z = zero_layout(n, mg_->world());
        const size_t p = size_t(z.padded_total());
        ASSERT_GE(int64_t(p), n);
        // The parameter and gradient buffers hold the padded total, the tail zeroed once.
        std::vector<floatX> grads(p, __float2bfloat16(0.0f));
        const std::vector<float> g = random_floats(size_t(n), uint64_t(n) + 3);
        for (int64_t i = 0; i < n; i++) grads[size_t(i)] = __float2bfloat16(g[size_t(i)]);
        DeviceBuffer<floatX> full(p), shard(size_t(z.shard_size));
        upload(full, grads);
        const ShardRange s = z.shard(mg_->rank());
        for (const bool sum : {false, true}) {
            cudaCheck(cudaMemset(shard.get(), 0xff, shard.bytes()));  // poison: NaN in bf16
            // The legacy stream's memset done before the collective on a non-blocking stream writes over it.
            cudaCheck(cudaDeviceSynchronize());
            if (sum) mg_->reduce_scatter_sum_async(full.get(), shard.get(), z, compute_);
            else mg_->reduce_scatter_mean_async(full.get(), shard.get(), z, compute_);
            mg_->join(compute_);
            cudaCheck(cudaStreamSynchronize(compute_));
            const std::vector<floatX> mine = to_host(shard);
            EXPECT_TRUE(bitwise_equal(mine, std::vector<floatX>(grads.begin() + s.begin, grads.begin() + s.end)))
                << n << (sum ? " sum" : " mean");
        }

        // An "update" writes new values into this rank's slice; the all-gather spreads them in place.
        std::vector<floatX> updated = grads;
        for (int64_t i = s.begin; i < std::min(s.end, n); i++) {
            updated[size_t(i)] = __float2bfloat16(2.0f * g[size_t(i)] + 1.0f);
        }
        DeviceBuffer<floatX> params(p);
        cudaCheck(cudaMemset(params.get(), 0xff, params.bytes()));
        cudaCheck(cudaMemcpy(params.get() + s.begin, updated.data() + s.begin, size_t(s.size()) * sizeof(floatX),
                             cudaMemcpyHostToDevice));
        cudaCheck(cudaDeviceSynchronize());  // the memset and the copy done before a non-blocking stream reads
        mg_->all_gather_async(params.get(), z, compute_);
        mg_->join(compute_);
        cudaCheck(cudaStreamSynchronize(compute_));
        EXPECT_TRUE(bitwise_equal(to_host(params), updated)) << n;
    }
}

TEST_F(MultiGpuTest, CollectivesWaitForTheComputeStream) {
    const int64_t n = 1 << 20;
    const ZeroLayout z = zero_layout(n, mg_->world());
    DeviceBuffer<float> full(size_t(z.padded_total())), shard(size_t(z.shard_size));
    cudaCheck(cudaMemset(full.get(), 0, full.bytes()));
    cudaCheck(cudaMemset(shard.get(), 0xff, shard.bytes()));
    cudaCheck(cudaDeviceSynchronize());
    // About 50 ms of spinning before the write: a reduce-scatter that did not wait would copy zeros.
    slow_fill<<<64, 256, 0, compute_>>>(full.get(), n, 3.0f, 100000000LL);
    cudaCheckLaunch();
    mg_->reduce_scatter_mean_async(full.get(), shard.get(), z, compute_);
    mg_->join(compute_);
    cudaCheck(cudaStreamSynchronize(compute_));
    const std::vector<float> got = to_host(shard);
    for (int64_t i = 0; i < n; i++) ASSERT_EQ(got[size_t(i)], 3.0f + float(i % 1000)) << i;
    for (int64_t i = n; i < z.shard_size; i++) ASSERT_EQ(got[size_t(i)], 0.0f) << i;
}

TEST_F(MultiGpuTest, ScalarsForTheLog) {
    DeviceBuffer<float> d(2);
    const std::vector<float> h = {3.2671f, 0.4413f};  // loss, grad norm
    upload(d, h);
    mg_->all_reduce_mean_async(d.get(), 2, compute_);
    mg_->join(compute_);
    cudaCheck(cudaStreamSynchronize(compute_));
    EXPECT_TRUE(bitwise_equal(to_host(d), h));
}

TEST_F(MultiGpuTest, BroadcastBarrierAndAgreement) {
    const std::vector<int32_t> h = {7, -3, 123456789};
    DeviceBuffer<int32_t> d(h.size());
    upload(d, h);
    mg_->broadcast_async(d.get(), h.size(), 0, compute_);
    mg_->join(compute_);
    cudaCheck(cudaStreamSynchronize(compute_));
    EXPECT_EQ(to_host(d), h);
    mg_->barrier();
    mg_->check_same(0x9e3779b97f4a7c15ull, "the parameter count");  // one rank always agrees with itself
}

TEST_F(MultiGpuTest, WrongLayoutIsRefused) {
    const ZeroLayout z = zero_layout(1000, 2);
    DeviceBuffer<float> full(size_t(z.padded_total()));
    try {
        mg_->all_gather_async(full.get(), z, compute_);
        ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("layout for 2 ranks used with 1"), std::string::npos) << e.what();
    }
}

TEST_F(GpuTest, ARankUsesItsLocalRanksGpuOrTheOnlyVisibleOne) {
    RankInfo r;
    r.local_rank = 99;
    const int devices = cuda_device_count();
    if (devices == 1) {
        // As under Slurm's --gpus-per-task=1 or a per-rank CUDA_VISIBLE_DEVICES: the one GPU it sees.
        MultiGpu mg(r, MultiGpuOptions{});
        EXPECT_EQ(mg.device(), 0);
        return;
    }
    try {
        MultiGpu mg(r, MultiGpuOptions{});
        ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitUsage);
        EXPECT_NE(std::string(e.what()).find("local rank 99"), std::string::npos) << e.what();
    }
}

TEST_F(MultiGpuTest, AbortIsIdempotentAndEndsCollectives) {
    EXPECT_FALSE(mg_->aborted());
    mg_->abort("a test stops this rank");
    mg_->abort("again");
    EXPECT_TRUE(mg_->aborted());
    DeviceBuffer<float> d(3);
    for (int which = 0; which < 3; which++) {
        try {
            if (which == 0) mg_->all_reduce_sum_async(d.get(), 3, compute_);
            if (which == 1) mg_->barrier();
            if (which == 2) mg_->check_same(1, "a value");
            ADD_FAILURE() << "a collective ran on an aborted communicator (" << which << ")";
        } catch (const Error& e) {
            EXPECT_EQ(e.exit_code(), kExitCuda);
            EXPECT_NE(std::string(e.what()).find("was aborted"), std::string::npos) << e.what();
        }
    }
    mg_.reset();  // nothing left to finalize
}

TEST_F(GpuTest, AnErrorUnwindingTheCommunicatorAbortsIt) {
    for (const bool guard : {false, true}) {
        testing::internal::CaptureStderr();
        try {
            MultiGpu mg(RankInfo{}, MultiGpuOptions{});
            DeviceBuffer<float> d(1 << 20);  // made after the MultiGpu: destroyed first
            const MultiGpuAbortOnError abort_on_error(guard ? &mg : nullptr);
            fail(kExitData, "a bad token in this rank's data");
        } catch (const Error& e) {
            EXPECT_EQ(e.exit_code(), kExitData);
        }
        const std::string err = testing::internal::GetCapturedStderr();
        EXPECT_NE(err.find("rank 0 of 1: an error ends this rank; aborting the NCCL communicator"), std::string::npos)
            << err;
        EXPECT_EQ(err.find("aborting", err.find("aborting") + 1), std::string::npos) << "aborted twice: " << err;
    }
    testing::internal::CaptureStderr();
    { MultiGpu mg(RankInfo{}, MultiGpuOptions{}); }
    const std::string quiet = testing::internal::GetCapturedStderr();
    EXPECT_EQ(quiet.find("aborting"), std::string::npos) << "a normal end finalizes, it does not abort: " << quiet;
}

TEST_F(GpuTest, TheHangTimeoutEndsARankAndNamesItsPhase) {
    EXPECT_EXIT(
        {
            MultiGpuOptions o;
            o.hang_timeout_s = 1;
            MultiGpu mg(RankInfo{}, o);
            mg.heartbeat("a long phase", 3.0);
            std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // past the timeout, within the allowance
            std::fprintf(stderr, "the allowance held\n");
            std::thread([&] { mg.heartbeat("a stuck phase"); }).join();  // any thread may beat
            std::this_thread::sleep_for(std::chrono::seconds(20));
            std::exit(0);
        },
        testing::ExitedWithCode(kExitCuda),
        "the allowance held.*no progress for [0-9]+ s while a stuck phase \\(allowed: 1 s.*aborting the NCCL");
}

// ------------------------------------------------------------------------------------------------
// global_norm of gradients summed over W ranks.

TEST_F(GpuTest, GlobalNormOfGradientsSummedOverRanks) {
    const int64_t n = 100003;
    const std::vector<float> h = random_floats(size_t(n), 29);
    std::vector<floatX> hb(static_cast<size_t>(n));
    double ref = 0;
    for (int64_t i = 0; i < n; i++) {
        hb[size_t(i)] = __float2bfloat16(h[size_t(i)]);
        const double v = double(__bfloat162float(hb[size_t(i)]));
        ref += v * v;
    }
    ref = std::sqrt(ref);
    DeviceBuffer<floatX> g(static_cast<size_t>(n));
    upload(g, hb);
    DeviceBuffer<float> scratch(kGlobalNormBlocks), out(8);
    auto run = [&](float max_norm, int ranks, bool sharded) {
        cudaCheck(cudaMemset(out.get(), 0xff, out.bytes()));
        if (sharded) {
            global_norm_sumsq(out.get() + 2, g.get(), n, scratch.get(), scratch.bytes(), nullptr);
            global_norm_finish(out.get(), out.get() + 1, out.get() + 2, max_norm, nullptr, ranks);
        } else if (ranks == 0) {
            global_norm(out.get(), out.get() + 1, g.get(), n, max_norm, scratch.get(), scratch.bytes(), nullptr);
        } else {
            global_norm(out.get(), out.get() + 1, g.get(), n, max_norm, scratch.get(), scratch.bytes(), nullptr, ranks);
        }
        std::vector<float> r = to_host(out);
        return std::vector<float>{r[0], r[1]};
    };
    const std::vector<float> plain = run(0.0f, 0, false);  // no ranks argument: one rank
    EXPECT_NEAR(double(plain[0]), ref, 1e-5 * ref);
    EXPECT_EQ(plain[1], 1.0f);
    EXPECT_TRUE(bitwise_equal(run(0.0f, 1, false), plain)) << "one rank changes no bit";
    const float max_norm = 0.25f * plain[0];
    const std::vector<float> clipped = run(max_norm, 0, false);
    EXPECT_TRUE(bitwise_equal(run(max_norm, 1, false), clipped));
    EXPECT_TRUE(bitwise_equal(run(max_norm, 1, true), clipped));
    for (int w : {2, 3, 5, 6, 7, 8}) {
        // The buffer holds the sum of w ranks' gradients: the norm is the mean gradient's, the scale the
        // clip factor of that norm times 1/w, both in fp32.
        const std::vector<float> got = run(0.0f, w, false);
        const float norm = plain[0] / float(w);
        EXPECT_EQ(got[0], norm) << w;
        EXPECT_EQ(got[1], 1.0f / float(w)) << w;
        EXPECT_NEAR(double(got[0]), ref / w, 1e-5 * ref / w) << w;
        const std::vector<float> c = run(max_norm / float(w), w, false);
        EXPECT_EQ(c[1], (max_norm / float(w) / norm) / float(w)) << w;
        EXPECT_TRUE(bitwise_equal(run(max_norm / float(w), w, true), c)) << "sharded path, " << w << " ranks";
        EXPECT_TRUE(bitwise_equal(run(2.0f * norm, w, false), got)) << "a norm under the limit is not clipped";
    }
    try {
        run(0.0f, -1, false);
        ADD_FAILURE() << "ranks -1 accepted";
    } catch (const Error& e) {
        EXPECT_EQ(e.exit_code(), kExitUsage);
    }
}

// ------------------------------------------------------------------------------------------------
// Several processes, one GPU each. The parent test starts this binary again per rank, with its role
// in the environment (LLMC_TEST_ROLE, LLMC_TEST_RANK, LLMC_TEST_WORLD, LLMC_TEST_RENDEZVOUS); main()
// runs the role instead of the tests.

namespace {

struct Child {
    pid_t pid = -1;
    std::string log;
    int status = -1;  // exit code; 128 + signal when killed; -1 while running
};

// Starts one rank of `role`; its output goes to `log`.
Child start_rank(const std::string& role, int rank, int world, const std::string& dir) {
    Child c;
    c.log = dir + "/rank" + std::to_string(rank) + ".log";
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; e++) {
        if (std::strncmp(*e, "LLMC_TEST_", 10) != 0) env.push_back(*e);
    }
    env.push_back("LLMC_TEST_ROLE=" + role);
    env.push_back("LLMC_TEST_RANK=" + std::to_string(rank));
    env.push_back("LLMC_TEST_WORLD=" + std::to_string(world));
    env.push_back("LLMC_TEST_RENDEZVOUS=" + dir);
    env.push_back("NCCL_NVLS_ENABLE=0");
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    char exe[] = "/proc/self/exe";
    char* argv[] = {exe, nullptr};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, c.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const int rc = posix_spawn(&c.pid, exe, &fa, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) throw std::runtime_error(std::string("posix_spawn: ") + std::strerror(rc));
    return c;
}

// Waits for every child up to timeout_s, then kills the rest (their status: 128 + SIGKILL).
void wait_ranks(std::vector<Child>& kids, double timeout_s) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(timeout_s * 1000));
    for (;;) {
        bool running = false;
        for (Child& c : kids) {
            if (c.status != -1) continue;
            int st = 0;
            if (::waitpid(c.pid, &st, WNOHANG) == c.pid) {
                c.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            } else {
                running = true;
            }
        }
        if (!running) return;
        if (std::chrono::steady_clock::now() >= deadline) {
            for (Child& c : kids) {
                if (c.status != -1) continue;
                ::kill(c.pid, SIGKILL);
                ::waitpid(c.pid, nullptr, 0);
                c.status = 128 + SIGKILL;
            }
            return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
}

std::string read_log(const std::string& path) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) return "(no log)";
    std::string s;
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) s.append(buf, n);
    std::fclose(f);
    return s;
}

int env_number(const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr ? std::atoi(v) : -1;
}

// Collects FAIL lines; the role's exit code is 1 if there is any.
struct Checks {
    int rank = 0;
    int failures = 0;
    void expect(bool ok, const std::string& what) {
        std::printf("%s rank %d: %s\n", ok ? "PASS" : "FAIL", rank, what.c_str());
        std::fflush(stdout);
        if (!ok) failures++;
    }
};

// Every collective on rank-dependent inputs: rank r contributes r+1 (times a pattern).
int role_collectives(MultiGpu& mg, cudaStream_t s) {
    const int r = mg.rank(), W = mg.world();
    Checks c{r};
    const float mean = float(W + 1) / 2.0f, sum = float(W * (W + 1) / 2);

    // fp32 mean (the trainer's losses): NCCL's average is within a rounding of (W+1)/2.
    {
        const size_t n = 1000003;
        DeviceBuffer<float> d(n);
        upload(d, std::vector<float>(n, float(r + 1)));
        mg.all_reduce_mean_async(d.get(), n, s);
        mg.join(s);
        cudaCheck(cudaStreamSynchronize(s));
        const std::vector<float> got = to_host(d);
        size_t bad = 0;
        for (float x : got) bad += std::fabs(x - mean) > 1e-6f * mean;  // W roundings of the 1/W products and sums
        c.expect(bad == 0,
                 format("fp32 all-reduce mean of r+1 is (W+1)/2 = %g (%zu of %zu elements off)", mean, bad, n));
    }
    // bf16 sum over ranges (a layer's gradient slices): W(W+1)/2 exactly inside, untouched outside.
    {
        const size_t n = 100003;
        const std::vector<ShardRange> ranges = {{0, 17}, {500, 9001}, {int64_t(n) - 3, int64_t(n)}};
        std::vector<floatX> h(n, __float2bfloat16(-float(r + 1)));
        for (const ShardRange& q : ranges) {
            for (int64_t i = q.begin; i < q.end; i++) h[size_t(i)] = __float2bfloat16(float(r + 1));
        }
        DeviceBuffer<floatX> d(n);
        upload(d, h);
        mg.all_reduce_sum_async(d.get(), ranges, s);
        mg.join(s);
        cudaCheck(cudaStreamSynchronize(s));
        const std::vector<floatX> got = to_host(d);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) {
            bool inside = false;
            for (const ShardRange& q : ranges) inside |= int64_t(i) >= q.begin && int64_t(i) < q.end;
            bad += __bfloat162float(got[i]) != (inside ? sum : -float(r + 1));
        }
        c.expect(bad == 0, format("bf16 all-reduce sum over ranges: W(W+1)/2 = %g inside, untouched outside (%zu off)",
                                  sum, bad));

        // The norm of those gradients' mean, from their sum: every element of the mean is (W+1)/2.
        DeviceBuffer<floatX> g(n);
        std::vector<floatX> all(n, __float2bfloat16(float(r + 1)));
        upload(g, all);
        mg.all_reduce_sum_async(g.get(), n, s);
        mg.join(s);
        DeviceBuffer<float> scratch(kGlobalNormBlocks), out(2);
        global_norm(out.get(), out.get() + 1, g.get(), int64_t(n), 0.0f, scratch.get(), scratch.bytes(), s, W);
        cudaCheck(cudaStreamSynchronize(s));
        const std::vector<float> ns = to_host(out);
        const double want = std::sqrt(double(n)) * mean;
        c.expect(std::fabs(ns[0] - want) <= 1e-5 * want && ns[1] == 1.0f / float(W),
                 format("global_norm of the summed gradients: %.6f (the mean's norm: %.6f), scale %g (1/W)", ns[0],
                        want, ns[1]));
    }
    // ZeRO-1: reduce-scatter sum and all-gather.
    {
        const int64_t n = 124439;
        const ZeroLayout z = zero_layout(n, W);
        const size_t p = size_t(z.padded_total());
        std::vector<floatX> full(p, __float2bfloat16(0.0f));
        for (int64_t i = 0; i < n; i++) full[size_t(i)] = __float2bfloat16(float((r + 1) * (1 + i % 5)));
        DeviceBuffer<floatX> d(p), shard(size_t(z.shard_size));
        upload(d, full);
        cudaCheck(cudaMemset(shard.get(), 0xff, shard.bytes()));
        cudaCheck(cudaDeviceSynchronize());  // the poison in place before a non-blocking stream writes over it
        mg.reduce_scatter_sum_async(d.get(), shard.get(), z, s);
        mg.join(s);
        cudaCheck(cudaStreamSynchronize(s));
        const std::vector<floatX> mine = to_host(shard);
        const ShardRange own = z.shard(r);
        size_t bad = 0;
        for (int64_t i = own.begin; i < own.end; i++) {
            const float want = i < n ? sum * float(1 + i % 5) : 0.0f;
            bad += __bfloat162float(mine[size_t(i - own.begin)]) != want;
        }
        c.expect(bad == 0, format("reduce-scatter sum into this rank's shard [%lld, %lld) (%zu off)",
                                  (long long)own.begin, (long long)own.end, bad));

        DeviceBuffer<floatX> params(p);
        cudaCheck(cudaMemset(params.get(), 0xff, params.bytes()));
        std::vector<floatX> slice(size_t(own.size()));
        for (int64_t i = own.begin; i < own.end; i++) {
            slice[size_t(i - own.begin)] = __float2bfloat16(float((r + 1) * (1 + i % 3)));
        }
        cudaCheck(cudaMemcpy(params.get() + own.begin, slice.data(), slice.size() * sizeof(floatX),
                             cudaMemcpyHostToDevice));
        cudaCheck(cudaDeviceSynchronize());  // as upload(): the copy done before a non-blocking stream reads
        mg.all_gather_async(params.get(), z, s);
        mg.join(s);
        cudaCheck(cudaStreamSynchronize(s));
        const std::vector<floatX> gathered = to_host(params);
        bad = 0;
        for (int q = 0; q < W; q++) {
            const ShardRange o = z.shard(q);
            for (int64_t i = o.begin; i < o.end; i++) {
                bad += __bfloat162float(gathered[size_t(i)]) != float((q + 1) * (1 + i % 3));
            }
        }
        c.expect(bad == 0, format("all-gather: every rank's slice everywhere (%zu off)", bad));
    }
    // Broadcast from the last rank.
    {
        DeviceBuffer<int32_t> d(5);
        upload(d, std::vector<int32_t>(5, 1000 + r));
        mg.broadcast_async(d.get(), 5, W - 1, s);
        mg.join(s);
        cudaCheck(cudaStreamSynchronize(s));
        c.expect(to_host(d) == std::vector<int32_t>(5, 1000 + W - 1), "broadcast from the last rank");
    }
    // Agreement: the same value passes everywhere, a rank-dependent one fails everywhere.
    mg.check_same(0x5eed, "a shared value");
    try {
        mg.check_same(uint64_t(r), "a rank-dependent value");
        c.expect(false, "check_same accepted a rank-dependent value");
    } catch (const Error& e) {
        c.expect(e.exit_code() == kExitUsage && std::string(e.what()).find("disagree") != std::string::npos,
                 std::string("check_same refuses a rank-dependent value: ") + e.what());
    }
    mg.barrier();
    return c.failures == 0 ? 0 : 1;
}

// Rank 1 aborts; rank 0 then waits in an all-reduce that can never complete: it must end (exit code
// kExitCuda) within its hang timeout, through NCCL's error or the watchdog, not hang.
int role_abort(MultiGpu& mg, cudaStream_t s) {
    mg.barrier();  // the connections are up
    if (mg.rank() == 1) {
        mg.abort("this rank stops (test)");
        try {
            mg.barrier();
            std::printf("FAIL rank 1: a barrier ran after abort()\n");
            return 1;
        } catch (const Error&) {
        }
        return 0;
    }
    mg.heartbeat("waiting for an aborted peer");
    DeviceBuffer<float> d(1 << 20);
    cudaCheck(cudaMemset(d.get(), 0, d.bytes()));
    mg.all_reduce_sum_async(d.get(), d.size(), s);
    mg.join(s);
    cudaCheck(cudaStreamSynchronize(s));
    std::printf("FAIL rank 0: an all-reduce with an aborted peer completed\n");
    return 1;
}

int run_role(const std::string& role) {
    return run_main([&]() -> int {
        RankInfo r;
        r.rank = env_number("LLMC_TEST_RANK");
        r.world = env_number("LLMC_TEST_WORLD");
        r.local_rank = r.rank;
        r.job = role;
        MultiGpuOptions o;
        o.rendezvous = std::getenv("LLMC_TEST_RENDEZVOUS");
        o.init_timeout_s = 60;
        o.hang_timeout_s = role == "abort" ? 5 : 120;
        MultiGpu mg(r, o);
        Stream stream;
        if (role == "collectives") return role_collectives(mg, stream.get());
        if (role == "abort") return role_abort(mg, stream.get());
        fail(kExitUsage, "unknown test role '%s'", role.c_str());
    });
}

class SeveralGpus : public GpuTest {
protected:
    void SetUp() override {
        GpuTest::SetUp();
        if (IsSkipped()) return;
        const int devices = cuda_device_count();
        if (devices < 2) GTEST_SKIP() << "skipped: needs 2 GPUs, this machine has " << devices;
        world_ = std::min(devices, 8);
    }
    int world_ = 2;
};

}  // namespace

TEST_F(SeveralGpus, CollectivesOnRankDependentInputs) {
    test::TempDir dir("multi_gpu_ranks");
    std::vector<Child> kids;
    for (int r = 0; r < world_; r++) kids.push_back(start_rank("collectives", r, world_, dir.path()));
    wait_ranks(kids, 300);
    for (int r = 0; r < world_; r++) {
        const std::string log = read_log(kids[size_t(r)].log);
        EXPECT_EQ(kids[size_t(r)].status, 0) << "rank " << r << " of " << world_ << ":\n" << log;
        EXPECT_EQ(log.find("FAIL"), std::string::npos) << log;
        EXPECT_NE(log.find("PASS rank " + std::to_string(r) + ": check_same refuses"), std::string::npos) << log;
    }
}

TEST_F(SeveralGpus, APeerThatAbortsEndsTheOtherRankNotHangsIt) {
    test::TempDir dir("multi_gpu_abort");
    std::vector<Child> kids;
    for (int r = 0; r < 2; r++) kids.push_back(start_rank("abort", r, 2, dir.path()));
    const auto t0 = std::chrono::steady_clock::now();
    wait_ranks(kids, 120);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string log0 = read_log(kids[0].log), log1 = read_log(kids[1].log);
    EXPECT_EQ(kids[1].status, 0) << log1;
    EXPECT_NE(log1.find("this rank stops (test); aborting the NCCL communicator"), std::string::npos) << log1;
    EXPECT_EQ(kids[0].status, int(kExitCuda)) << "rank 0 (hang timeout 5 s) after " << s << " s:\n" << log0;
    EXPECT_LT(s, 60.0) << log0;
}

int main(int argc, char** argv) {
    if (const char* role = std::getenv("LLMC_TEST_ROLE")) return run_role(role);
    testing::InitGoogleTest(&argc, argv);
    GTEST_FLAG_SET(death_test_style, "threadsafe");  // the death test starts a fresh process: CUDA cannot fork
    return RUN_ALL_TESTS();
}
