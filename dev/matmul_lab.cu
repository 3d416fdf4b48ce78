/*
matmul_lab: is cuBLASLt's first heuristic choice (the algorithm gemm() runs) the fastest one for the
matmuls the trainer runs, and how much of a training step would picking another one save?

  build/matmul_lab [--B 64] [--T 1024] [--C 768] [--Vp 50304] [--layers 12] [--algos 16]
                   [--sustain SECONDS | --sustain-each SECONDS] [--gelu-kernel]

Makes the 15 distinct gemm() calls of one GPT-2 forward and backward at these sizes (d12 by default,
N = B*T rows), each with exactly the arguments matmul_forward / matmul_backward of llmc/matmul.cuh pass
to gemm() (through detail::GemmCall, gemm()'s own cuBLASLt setup): forward of qkv, attention projection,
fc (GELU_AUX_BIAS epilogue, pre-GELU kept in aux), fc projection and the LM head (padded vocabulary, no
bias); the dinp matmul of each (DGELU epilogue for the fc projection, whose input is the GELU output); the
dweight matmul of each (beta = 1, accumulating). With --gelu-kernel, fc forward and fc projection dinp are
the plain matmuls (BIAS epilogue; none) that GELU as a kernel of its own would follow. The bias gradients are our own kernel, not cuBLASLt's.
For each call it asks the heuristic for up to --algos results and, for each, runs it once from a fixed
start (D reset to its initial contents for beta = 1, else poisoned with NaNs, so that an unwritten
element shows) and compares D (and the aux output of the GELU forward) bitwise with rank 0's, runs it a
second time from the same start to see whether it repeats its own bits, then warms up (--warmup runs) and
times --reps runs one by one with CUDA events (median). Results the heuristic marks as failed, or that
need more workspace than the trainer's CublasLt has, are listed and skipped.

Prints a row per (call, rank): algo id, tile id (cublasLtMatmulTile_t), splitK, reduction scheme
(cublasLtReductionScheme_t), stages id (cublasLtMatmulStages_t), cluster shape id
(cublasLtClusterShape_t), the ids being cublasLt.h's enum values; the workspace the result needs; the
heuristic's waves count; median ms and TFLOP/s (2*M*N*K / time); "=r0" (bitwise equal to rank 0),
and "rep" (the same bits twice). Where the fastest median is not rank 0's, rank 0 and the fastest are
re-timed alternately, run by run, with 3x --reps runs each (the fastest of 16 noisy medians is biased
low). Then a summary per call: rank 0's time, the best time and its rank, and over one forward +
backward of a B x T micro-batch (per-layer calls --layers times, the LM head's once) the matmul time with
rank 0 everywhere against the best rank everywhere, from the re-timed figures.

Before that summary, the MLP's GELU both ways at the same sizes: the trainer's epilogues (fc forward with
GELU_AUX_BIAS, fc projection dinp with DGELU) against plain matmuls followed by our GELU kernels
(gelu_forward of llmc/gelu.cuh; gelu_backward, which only this lab keeps): their outputs compared (within
bf16 rounding, exit 1 otherwise) and both timed.

Inputs are uniform in [-0.5, 0.5] from a seeded generator on the host; large tensors repeat an odd-sized
block of values (see fill_random). Operands stay in L2 between back-to-back runs where they fit (the
per-layer weights do), which they would not in the trainer: small calls may time a little fast.
Rank 0 of a request for --algos results is checked to be the algorithm a request for one returns (the
one gemm() runs). Runtime at d12 on an H200: 15 calls x up to 16 ranks x 27 runs (2 checked, 5 warm-up,
20 timed) of ~27 ms per pass over the 15 calls, plus the re-timing: ~20-30 s.

With --sustain S (seconds) the sweep is skipped: every call's tensors are made at once and the step's
whole sequence of matmuls (each call per_step times, rank 0's algorithm: what gemm() runs untuned) is run
back to back for S seconds after a 2-second idle, with a CUDA event between calls. Prints the first
sequence's time (started from idle clocks) against the median of the sequences in the last half, per
call and in all: the matmul part of a step at the clock the GPU holds under sustained load (an H200 at
its 700 W power cap runs at ~1.5 GHz against 1.98 GHz boost), i.e. a floor for the step that no faster
non-matmul kernel can go below. Needs every call's tensors at once (~25 GB at d12 B=64).

With --sustain-each S, each call's heuristic results (up to --algos) are run one after another, each
back to back for S seconds after the call's rank 0 has run for one second: the median time per run over
each result's last half, at the clock the power cap leaves for that algorithm alone. Under the cap an
algorithm's energy per run decides its speed, so this ranking can differ from the sweep's, which times
short bursts.

Does not provide: choosing algorithms in the trainer; cuBLASLt's exhaustive search
(cublasLtMatmulAlgoGetIds); attention's batched matmuls (llmc/attention.cuh).
*/
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/flags.h"
#include "llmc/gelu.cuh"
#include "llmc/matmul.cuh"
#include "llmc/utils.h"

using namespace llmc;

namespace {

struct Options {
    int B = 64;
    int T = 1024;
    int C = 768;
    int Vp = 50304;
    int layers = 12;
    int algos = 16;
    int warmup = 5;
    int reps = 20;
    double sustain = 0;       // seconds; > 0: the sustained sequence instead of the sweep
    double sustain_each = 0;  // seconds per heuristic result; > 0: each call's results sustained
    bool gelu_kernel = false;  // fc fwd and fcproj dinp as plain matmuls (GELU as its own kernel)
};

// Returns false when --help was given.
bool parse_args(int argc, char** argv, Options& o) {
    Flags flags("matmul_lab", "Times every algorithm cuBLASLt's heuristic offers for the trainer's matmuls.");
    flags.add("", "B", &o.B, "batch size", 1, 1 << 16)
        .add("", "T", &o.T, "sequence length", 1, 1 << 20)
        .add("", "C", &o.C, "channels (qkv: 3C, fc: 4C)", 8, 1 << 16)
        .add("", "Vp", &o.Vp, "padded vocabulary size (the LM head's OC)", 8, 1 << 22)
        .add("", "layers", &o.layers, "layers: the per-layer calls' count per step in the summary", 1, 1024)
        .add("", "algos", &o.algos, "heuristic results asked for per call", 1, 128)
        .add("", "warmup", &o.warmup, "untimed runs per result before timing", 0, 1000)
        .add("", "reps", &o.reps, "timed runs per result (median)", 1, 10000)
        .add("", "sustain", &o.sustain, "seconds of the step's matmul sequence back to back (0: the sweep)", 0.0,
             3600.0)
        .add("", "sustain-each", &o.sustain_each, "seconds of each heuristic result back to back (0: the sweep)", 0.0,
             600.0)
        .add_switch("", "gelu-kernel", &o.gelu_kernel,
                    "fc fwd and fcproj dinp without their GELU epilogues, as plain matmuls (the GELU as its own "
                    "kernel)");
    if (!flags.parse(argc, argv)) return false;
    if (o.sustain > 0 && o.sustain_each > 0) fail(kExitUsage, "matmul_lab: give --sustain or --sustain-each, not both");
    std::fputs(flags.settings_table().c_str(), stdout);
    return true;
}

// ----------------------------------------------------------------------------------------------------
// Device tensors.

// Uniform values in [-amp, amp] from a seeded generator on the host. A tensor longer than kFillBlock
// repeats its first kFillBlock values (copied on the device), so that the 3.3G elements of the d12
// logits take a fraction of a second; the block is odd-sized, so the repeats do not line up with rows.
constexpr size_t kFillBlock = (size_t(1) << 22) + 1;

void fill_random(floatX* d, size_t n, uint64_t seed, float amp) {
    std::vector<floatX> h(std::min(n, kFillBlock));
    const uint64_t key = rng_key(seed, 0);
    for (size_t i = 0; i < h.size(); i++) {
        const float u = float(rng_u32(key, i) >> 8) * (1.0f / 16777216.0f);  // [0, 1)
        h[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * amp);
    }
    cudaCheck(cudaMemcpy(d, h.data(), h.size() * sizeof(floatX), cudaMemcpyHostToDevice));
    for (size_t off = h.size(); off < n; off += h.size()) {
        cudaCheck(cudaMemcpy(d + off, d, std::min(h.size(), n - off) * sizeof(floatX), cudaMemcpyDeviceToDevice));
    }
}

void poison(void* p, size_t bytes) { cudaCheck(cudaMemset(p, 0xff, bytes)); }  // all-ones: NaN in bf16

// Number of 16-bit words where x and y differ.
__global__ void count_diff_kernel(const uint16_t* x, const uint16_t* y, size_t n, unsigned long long* count) {
    unsigned long long c = 0;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        c += x[i] != y[i] ? 1 : 0;
    }
    if (c != 0) atomicAdd(count, c);
}

// Number of bf16 infinities and NaNs (exponent all ones).
__global__ void count_nonfinite_kernel(const uint16_t* x, size_t n, unsigned long long* count) {
    unsigned long long c = 0;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        c += (x[i] & 0x7f80u) == 0x7f80u ? 1 : 0;
    }
    if (c != 0) atomicAdd(count, c);
}

class Counter {
public:
    Counter() : count_(1) {}
    unsigned long long* reset() {
        cudaCheck(cudaMemset(count_.get(), 0, sizeof(unsigned long long)));
        return count_.get();
    }
    unsigned long long read() const {
        unsigned long long c = 0;
        cudaCheck(cudaMemcpy(&c, count_.get(), sizeof(c), cudaMemcpyDeviceToHost));
        return c;
    }

private:
    DeviceBuffer<unsigned long long> count_;
};

unsigned long long count_diff(const floatX* x, const floatX* y, size_t n, Counter& counter) {
    count_diff_kernel<<<1024, 256>>>(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(y), n,
                                     counter.reset());
    cudaCheckLaunch();
    return counter.read();
}

unsigned long long count_nonfinite(const floatX* x, size_t n, Counter& counter) {
    count_nonfinite_kernel<<<1024, 256>>>(reinterpret_cast<const uint16_t*>(x), n, counter.reset());
    cudaCheckLaunch();
    return counter.read();
}

void copy_device(floatX* dst, const floatX* src, size_t n) {
    cudaCheck(cudaMemcpy(dst, src, n * sizeof(floatX), cudaMemcpyDeviceToDevice));
}

// ----------------------------------------------------------------------------------------------------
// The trainer's calls.

// One gemm() call with its tensors. D (and aux, where the epilogue writes it) is what the call produces;
// with beta = 1 (accumulate) D's initial contents are an input too.
struct Case {
    std::string name;
    int64_t M = 0, N = 0, K = 0;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    int per_step = 1;
    bool accumulate = false;
    std::vector<DeviceBuffer<floatX>> tensors;
    floatX* d = nullptr;
    size_t d_count = 0;
    floatX* aux_out = nullptr;  // written by GELU_AUX(_BIAS)
    size_t aux_count = 0;
    std::unique_ptr<detail::GemmCall> call;

    floatX* add_tensor(size_t n, uint64_t seed) {
        tensors.emplace_back(n);
        fill_random(tensors.back().get(), n, seed, 0.5f);
        return tensors.back().get();
    }
};

// The tensors of each case get their own seeds.
uint64_t next_seed() {
    static uint64_t seed = 1337;
    return seed++;
}

// matmul_forward(lt, out, inp, weight, bias, N, C, OC, stream, pre_gelu)'s gemm() call (llmc/matmul.cuh),
// with inp (N,C), weight (OC,C), bias (OC) when with_bias, pre_gelu (N,OC) when with_gelu.
Case forward_case(const CublasLt& lt, cudaStream_t stream, const char* name, int per_step, int64_t N, int C, int OC,
                  bool with_bias, bool with_gelu) {
    Case c;
    c.name = name;
    c.per_step = per_step;
    const floatX* inp = c.add_tensor(size_t(N) * C, next_seed());
    const floatX* weight = c.add_tensor(size_t(OC) * C, next_seed());
    const floatX* bias = with_bias ? c.add_tensor(size_t(OC), next_seed()) : nullptr;
    floatX* pre_gelu = with_gelu ? c.add_tensor(size_t(N) * OC, next_seed()) : nullptr;
    floatX* out = c.add_tensor(size_t(N) * OC, next_seed());
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    if (pre_gelu != nullptr) {
        epilogue = bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    } else if (bias != nullptr) {
        epilogue = CUBLASLT_EPILOGUE_BIAS;
    }
    c.call = std::make_unique<detail::GemmCall>(lt, stream, N, OC, C, GemmOperand{inp, C, false, 0},
                                                GemmOperand{weight, C, true, 0}, out, CUDA_R_16BF, OC, 0, 1, 1.0f,
                                                0.0f, epilogue, bias, pre_gelu, OC);
    c.M = N;
    c.N = OC;
    c.K = C;
    c.epilogue = epilogue;
    c.d = out;
    c.d_count = size_t(N) * OC;
    c.aux_out = pre_gelu;
    c.aux_count = pre_gelu != nullptr ? size_t(N) * OC : 0;
    return c;
}

// matmul_backward(lt, dinp, dweight, dbias, dout, inp, weight, N, C, OC, ..., pre_gelu)'s dinp gemm() call,
// with dout (N,OC), weight (OC,C), pre_gelu (N,C) when with_gelu.
Case dinp_case(const CublasLt& lt, cudaStream_t stream, const char* name, int per_step, int64_t N, int C, int OC,
               bool with_gelu) {
    Case c;
    c.name = name;
    c.per_step = per_step;
    const floatX* dout = c.add_tensor(size_t(N) * OC, next_seed());
    const floatX* weight = c.add_tensor(size_t(OC) * C, next_seed());
    const floatX* pre_gelu = with_gelu ? c.add_tensor(size_t(N) * C, next_seed()) : nullptr;
    floatX* dinp = c.add_tensor(size_t(N) * C, next_seed());
    const cublasLtEpilogue_t epilogue = pre_gelu != nullptr ? CUBLASLT_EPILOGUE_DGELU : CUBLASLT_EPILOGUE_DEFAULT;
    c.call = std::make_unique<detail::GemmCall>(lt, stream, N, C, OC, GemmOperand{dout, OC, false, 0},
                                                GemmOperand{weight, C, false, 0}, dinp, CUDA_R_16BF, C, 0, 1, 1.0f,
                                                0.0f, epilogue, nullptr, const_cast<floatX*>(pre_gelu), C);
    c.M = N;
    c.N = C;
    c.K = OC;
    c.epilogue = epilogue;
    c.d = dinp;
    c.d_count = size_t(N) * C;
    return c;
}

// matmul_backward's dweight gemm() call: dweight (OC,C) += dout (N,OC)^T @ inp (N,C).
Case dweight_case(const CublasLt& lt, cudaStream_t stream, const char* name, int per_step, int64_t N, int C, int OC) {
    Case c;
    c.name = name;
    c.per_step = per_step;
    const floatX* dout = c.add_tensor(size_t(N) * OC, next_seed());
    const floatX* inp = c.add_tensor(size_t(N) * C, next_seed());
    floatX* dweight = c.add_tensor(size_t(OC) * C, next_seed());
    c.call = std::make_unique<detail::GemmCall>(lt, stream, OC, C, N, GemmOperand{dout, OC, true, 0},
                                                GemmOperand{inp, C, false, 0}, dweight, CUDA_R_16BF, C, 0, 1, 1.0f,
                                                1.0f);
    c.M = OC;
    c.N = C;
    c.K = N;
    c.accumulate = true;
    c.d = dweight;
    c.d_count = size_t(OC) * C;
    return c;
}

// ----------------------------------------------------------------------------------------------------
// Measurement.

// -1 where cuBLASLt does not report an attribute for this algorithm.
struct AlgoInfo {
    int64_t id = -1, splitk = -1, tile = -1, stages = -1, reduction = -1, cluster = -1;
};

// An algorithm's configuration attribute, whatever its width (cuBLASLt's are 16- or 32-bit): the size is
// asked first (sizeInBytes 0), then the value is read into the low bytes of a zeroed 64-bit integer
// (little-endian); -1 when the size query or the read is refused.
int64_t algo_attribute(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
    size_t size = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, nullptr, 0, &size) != CUBLAS_STATUS_SUCCESS || size == 0 ||
        size > sizeof(uint64_t)) {
        return -1;
    }
    uint64_t value = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, size, &written) != CUBLAS_STATUS_SUCCESS) return -1;
    return static_cast<int64_t>(value);
}

AlgoInfo algo_info(const cublasLtMatmulAlgo_t& algo) {
    AlgoInfo a;
    a.id = algo_attribute(algo, CUBLASLT_ALGO_CONFIG_ID);
    a.tile = algo_attribute(algo, CUBLASLT_ALGO_CONFIG_TILE_ID);
    a.splitk = algo_attribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
    a.reduction = algo_attribute(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
    a.stages = algo_attribute(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID);
    a.cluster = algo_attribute(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
    return a;
}

constexpr int kConfirmRounds = 3;

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The median of v's second half: what a sustained run settles to, leaving out the climb to the power cap.
double last_half_median(const std::vector<double>& v) {
    return median(std::vector<double>(v.begin() + std::ptrdiff_t(v.size() / 2), v.end()));
}

// One run of c with algo between two events, in ms (waits for it).
double time_run(const Case& c, const cublasLtMatmulAlgo_t& algo, cudaStream_t stream, const Event& start,
                const Event& stop) {
    cudaCheck(cudaEventRecord(start, stream));
    c.call->run(algo);
    cudaCheck(cudaEventRecord(stop, stream));
    cudaCheck(cudaEventSynchronize(stop));
    float t = 0;
    cudaCheck(cudaEventElapsedTime(&t, start, stop));
    return double(t);
}

struct Summary {
    std::string name;
    int per_step = 1;
    double rank0_ms = -1, best_ms = -1;  // the sweep's medians
    int best_rank = -1;
    bool best_equal = true;                  // the best rank's output is bitwise rank 0's
    double confirm0_ms = -1, confirm_best_ms = -1;  // rank 0 and the best re-timed, interleaved
};

// Runs every heuristic result of one case; prints its rows and returns its summary.
Summary run_case(const CublasLt& lt, cudaStream_t stream, Case& c, const Options& o, Counter& counter) {
    Summary s;
    s.name = c.name;
    s.per_step = c.per_step;
    const double flop = 2.0 * double(c.M) * double(c.N) * double(c.K);
    const std::vector<cublasLtMatmulHeuristicResult_t> results = c.call->heuristics(o.algos);
    if (results.empty()) c.call->fail_no_algorithm();
    // gemm() asks for one result: rank 0 of a longer list should be that one.
    const std::vector<cublasLtMatmulHeuristicResult_t> first = c.call->heuristics(1);
    const bool same_first = std::memcmp(&first[0].algo, &results[0].algo, sizeof(cublasLtMatmulAlgo_t)) == 0;
    std::printf("\n%s: M=%lld N=%lld K=%lld epilogue=%s beta=%d, x%d per step, %zu heuristic result(s)%s\n",
                c.name.c_str(), (long long)c.M, (long long)c.N, (long long)c.K, detail::epilogue_name(c.epilogue),
                c.accumulate ? 1 : 0, c.per_step, results.size(),
                same_first ? "" : "; WARNING: rank 0 differs from a request for one result (gemm()'s choice)");
    std::printf("%4s | %6s | %5s | %6s | %3s | %6s | %7s | %10s | %6s | %9s | %8s | %4s | %s\n", "rank", "algo", "tile",
                "splitK", "red", "stages", "cluster", "workspace", "waves", "median ms", "TFLOP/s", "=r0", "rep");

    // The start of each comparison run: beta = 1 accumulates into D's initial contents, so they are kept;
    // otherwise D (and aux) are poisoned, so that an element an algorithm leaves unwritten shows.
    DeviceBuffer<floatX> d_init(c.accumulate ? c.d_count : 0), d_ref(c.d_count), d_first(c.d_count);
    DeviceBuffer<floatX> aux_ref(c.aux_count), aux_first(c.aux_count);
    if (c.accumulate) copy_device(d_init.get(), c.d, c.d_count);
    auto reset = [&] {
        if (c.accumulate) {
            copy_device(c.d, d_init.get(), c.d_count);
        } else {
            poison(c.d, c.d_count * sizeof(floatX));
        }
        if (c.aux_out != nullptr) poison(c.aux_out, c.aux_count * sizeof(floatX));
        // cudaMemset and device-to-device cudaMemcpy may return before they finish, and the matmuls run on a
        // non-blocking stream: without this the next run could start before D is reset (and every forward
        // then reads as not repeating its own bits).
        cudaCheck(cudaDeviceSynchronize());
    };
    auto differing = [&](const floatX* d_other, const floatX* aux_other) {
        unsigned long long n = count_diff(c.d, d_other, c.d_count, counter);
        if (c.aux_out != nullptr) n += count_diff(c.aux_out, aux_other, c.aux_count, counter);
        return n;
    };

    Event start(true), stop(true);
    auto time_one = [&](const cublasLtMatmulAlgo_t& algo) { return time_run(c, algo, stream, start, stop); };
    bool have_ref = false;
    for (size_t r = 0; r < results.size(); r++) {
        const cublasLtMatmulHeuristicResult_t& h = results[r];
        if (h.state != CUBLAS_STATUS_SUCCESS || h.workspaceSize > lt.workspace_bytes()) {
            std::printf("%4zu | skipped: state %s, workspace %zu of %zu bytes\n", r, cublasLtGetStatusName(h.state),
                        h.workspaceSize, lt.workspace_bytes());
            continue;
        }
        const AlgoInfo a = algo_info(h.algo);
        // First run, from the fixed start; a cuBLAS error here skips the result (the heuristic offered it,
        // so that would be worth knowing, not worth stopping for).
        reset();
        try {
            c.call->run(h.algo);
        } catch (const Error& e) {
            std::printf("%4zu | %6lld | skipped: %s\n", r, (long long)a.id, e.what());
            continue;
        }
        cudaCheck(cudaStreamSynchronize(stream));
        std::string equal = "ref";
        if (!have_ref) {
            have_ref = true;
            if (r != 0) std::printf("WARNING: rank 0 was skipped; rank %zu is the reference\n", r);
            copy_device(d_ref.get(), c.d, c.d_count);
            if (c.aux_out != nullptr) copy_device(aux_ref.get(), c.aux_out, c.aux_count);
            unsigned long long bad = count_nonfinite(c.d, c.d_count, counter);
            if (c.aux_out != nullptr) bad += count_nonfinite(c.aux_out, c.aux_count, counter);
            if (bad != 0) std::printf("WARNING: the reference has %llu non-finite elements (unwritten or overflow)\n", bad);
        } else {
            const unsigned long long n = differing(d_ref.get(), aux_ref.get());
            equal = n == 0 ? "yes" : format("no (%llu differ)", n);
        }
        // A second run from the same start: does the algorithm repeat its own bits?
        copy_device(d_first.get(), c.d, c.d_count);
        if (c.aux_out != nullptr) copy_device(aux_first.get(), c.aux_out, c.aux_count);
        reset();
        c.call->run(h.algo);
        cudaCheck(cudaStreamSynchronize(stream));
        const unsigned long long n_rep = differing(d_first.get(), aux_first.get());
        const std::string repeat = n_rep == 0 ? "yes" : format("NO (%llu differ)", n_rep);

        for (int i = 0; i < o.warmup; i++) c.call->run(h.algo);
        std::vector<double> ms;
        for (int i = 0; i < o.reps; i++) ms.push_back(time_one(h.algo));
        const double med = median(ms);
        std::printf("%4zu | %6lld | %5lld | %6lld | %3lld | %6lld | %7lld | %10zu | %6.2f | %9.4f | %8.1f | %4s | %s\n",
                    r, (long long)a.id, (long long)a.tile, (long long)a.splitk, (long long)a.reduction,
                    (long long)a.stages, (long long)a.cluster, h.workspaceSize, double(h.wavesCount), med,
                    flop / (med * 1e-3) / 1e12, equal.c_str(), repeat.c_str());
        if (r == 0) s.rank0_ms = med;
        if (s.best_ms < 0 || med < s.best_ms) {
            s.best_ms = med;
            s.best_rank = int(r);
            s.best_equal = equal == "ref" || equal == "yes";
        }
    }

    // The fastest of many noisy medians is biased low: re-time rank 0 and the best alternately, run by
    // run (so that clock drift hits both alike), kConfirmRounds times as many runs as above.
    if (s.best_rank > 0 && s.rank0_ms >= 0) {
        const cublasLtMatmulAlgo_t& a0 = results[0].algo;
        const cublasLtMatmulAlgo_t& ab = results[size_t(s.best_rank)].algo;
        for (int i = 0; i < o.warmup; i++) {
            c.call->run(a0);
            c.call->run(ab);
        }
        std::vector<double> ms0, msb;
        for (int i = 0; i < kConfirmRounds * o.reps; i++) {
            ms0.push_back(time_one(a0));
            msb.push_back(time_one(ab));
        }
        s.confirm0_ms = median(ms0);
        s.confirm_best_ms = median(msb);
        std::printf("re-timed, interleaved: rank 0 %.4f ms, rank %d %.4f ms\n", s.confirm0_ms, s.best_rank,
                    s.confirm_best_ms);
    } else {
        s.confirm0_ms = s.rank0_ms;
        s.confirm_best_ms = s.best_ms;
    }
    return s;
}

// --sustain: the step's matmul sequence back to back for o.sustain seconds (see the header).
void run_sustained(std::vector<Case>& cases, cudaStream_t stream, const Options& o) {
    std::vector<cublasLtMatmulAlgo_t> algos;
    double flop = 0;
    for (Case& c : cases) {
        const std::vector<cublasLtMatmulHeuristicResult_t> r = c.call->heuristics(1);
        if (r.empty()) c.call->fail_no_algorithm();
        algos.push_back(r[0].algo);
        flop += 2.0 * double(c.M) * double(c.N) * double(c.K) * c.per_step;
    }
    const size_t n = cases.size();
    std::vector<std::unique_ptr<Event>> marks;
    for (size_t i = 0; i <= n; i++) marks.push_back(std::make_unique<Event>(true));
    std::vector<std::vector<double>> per_call(n);  // ms per sequence, by call
    std::vector<double> total;
    auto sequence = [&] {
        cudaCheck(cudaEventRecord(*marks[0], stream));
        for (size_t i = 0; i < n; i++) {
            for (int k = 0; k < cases[i].per_step; k++) cases[i].call->run(algos[i]);
            cudaCheck(cudaEventRecord(*marks[i + 1], stream));
        }
        cudaCheck(cudaEventSynchronize(*marks[n]));
        double sum = 0;
        for (size_t i = 0; i < n; i++) {
            float t = 0;
            cudaCheck(cudaEventElapsedTime(&t, *marks[i], *marks[i + 1]));
            per_call[i].push_back(double(t));
            sum += double(t);
        }
        total.push_back(sum);
    };
    sequence();  // cuBLASLt's first-use costs, not counted
    per_call.assign(n, {});
    total.clear();
    std::this_thread::sleep_for(std::chrono::seconds(2));
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < o.sustain) sequence();
    const size_t runs = total.size(), half = runs / 2;
    if (runs < 4) fail(kExitUsage, "matmul_lab: --sustain %.1f ran %zu sequences; give it longer", o.sustain, runs);
    std::printf("\nsustained: the step's matmul sequence %zu times in %.1f s (rank 0 everywhere); first sequence "
                "(from idle) against the median of the last %zu\n",
                runs, o.sustain, runs - half);
    std::printf("%-16s | %5s | %10s | %10s | %7s\n", "call", "x", "first ms", "steady ms", "slower");
    for (size_t i = 0; i < n; i++) {
        const double f = per_call[i][0], st = last_half_median(per_call[i]);
        std::printf("%-16s | %5d | %10.3f | %10.3f | %6.1f%%\n", cases[i].name.c_str(), cases[i].per_step, f, st,
                    100.0 * (st / f - 1.0));
    }
    const double f = total[0], st = last_half_median(total);
    std::printf("%-16s | %5s | %10.3f | %10.3f | %6.1f%%\n", "sequence", "", f, st, 100.0 * (st / f - 1.0));
    std::printf("matmuls of one step: %.2f ms from idle (%.0f TFLOP/s), %.2f ms sustained (%.0f TFLOP/s); min %.2f "
                "max %.2f over the last %zu\n",
                f, flop / (f * 1e-3) / 1e12, st, flop / (st * 1e-3) / 1e12,
                *std::min_element(total.begin() + std::ptrdiff_t(half), total.end()),
                *std::max_element(total.begin() + std::ptrdiff_t(half), total.end()), runs - half);
}

// --sustain-each: every heuristic result of one call, each back to back for o.sustain_each seconds.
void run_sustained_each(const CublasLt& lt, Case& c, cudaStream_t stream, const Options& o) {
    const std::vector<cublasLtMatmulHeuristicResult_t> results = c.call->heuristics(o.algos);
    if (results.empty()) c.call->fail_no_algorithm();
    const double flop = 2.0 * double(c.M) * double(c.N) * double(c.K);
    Event start(true), stop(true);
    // Runs algo back to back for `seconds`, a CUDA event pair around each run.
    // (Between runs the GPU waits only for the host's ~10 us round trip, which leaves it at the cap.)
    auto sustained = [&](const cublasLtMatmulAlgo_t& algo, double seconds) {
        std::vector<double> ms;
        const auto t0 = std::chrono::steady_clock::now();
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
            ms.push_back(time_run(c, algo, stream, start, stop));
        }
        return last_half_median(ms);
    };
    std::printf("\n%s sustained: M=%lld N=%lld K=%lld epilogue=%s, x%d per step; each result %.2f s back to back\n",
                c.name.c_str(), (long long)c.M, (long long)c.N, (long long)c.K, detail::epilogue_name(c.epilogue),
                c.per_step, o.sustain_each);
    std::printf("%4s | %6s | %5s | %6s | %10s | %8s\n", "rank", "algo", "tile", "splitK", "median ms", "TFLOP/s");
    sustained(results[0].algo, 1.0);  // to the power cap first
    double best = -1, r0 = -1;
    size_t best_rank = 0;
    for (size_t r = 0; r < results.size(); r++) {
        const cublasLtMatmulHeuristicResult_t& h = results[r];
        if (h.state != CUBLAS_STATUS_SUCCESS || h.workspaceSize > lt.workspace_bytes()) {
            std::printf("%4zu | skipped\n", r);
            continue;
        }
        const AlgoInfo a = algo_info(h.algo);
        double med = 0;
        try {
            med = sustained(h.algo, o.sustain_each);
        } catch (const Error& e) {
            std::printf("%4zu | %6lld | skipped: %s\n", r, (long long)a.id, e.what());
            continue;
        }
        std::printf("%4zu | %6lld | %5lld | %6lld | %10.4f | %8.1f\n", r, (long long)a.id, (long long)a.tile,
                    (long long)a.splitk, med, flop / (med * 1e-3) / 1e12);
        if (r == 0) r0 = med;
        if (best < 0 || med < best) {
            best = med;
            best_rank = r;
        }
    }
    if (r0 < 0) {
        std::printf("%s: rank 0 skipped, nothing to compare with\n", c.name.c_str());
        return;
    }
    std::printf("%s: rank 0 %.4f ms, best rank %zu %.4f ms (%.1f%%), x%d per step: %.3f ms per step\n", c.name.c_str(),
                r0, best_rank, best, 100.0 * (1.0 - best / r0), c.per_step, (r0 - best) * c.per_step);
}

// ----------------------------------------------------------------------------------------------------
// GELU as a kernel of its own, against the epilogues the trainer uses.

// GELU'(x) of the tanh approximation (llmc/gelu.cuh's gelu() differentiated).
__device__ inline float gelu_grad(float x) {
    const float th = tanhf(kGeluScale * (x + kGeluCubic * x * x * x));
    const float dth = (1.0f - th * th) * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * dth;
}

// dinp = GELU'(inp) * dout over n elements, 8 per thread; dinp may be dout itself (each element is read,
// then written, by the same thread).
__global__ void gelu_backward_kernel(floatX* dinp, const floatX* inp, const floatX* dout, int64_t n) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPackX;
    if (i >= n) return;
    const PackX x = load128(inp + i);
    const PackX d = load128(dout + i);
    PackX o;
    for (int k = 0; k < kPackX; k++) o[k] = __float2bfloat16_rn(gelu_grad(float(x[k])) * float(d[k]));
    store128(dinp + i, o);
}

void gelu_backward(floatX* dinp, const floatX* inp, const floatX* dout, int64_t n, cudaStream_t stream) {
    require_pack_multiple(n, "gelu_backward: n");
    const int block = 256;
    gelu_backward_kernel<<<unsigned(ceil_div<int64_t>(n / kPackX, block)), block, 0, stream>>>(dinp, inp, dout, n);
    cudaCheckLaunch();
}

constexpr int kDiffBlocks = 1024, kDiffThreads = 256;
constexpr double kGeluTol = 1e-2;  // a few bf16 roundings (one is 2^-9 relative)

// Per block, the sums of (x - y)^2 and of y^2 over n bf16 elements.
__global__ void __launch_bounds__(kDiffThreads) sq_diff_kernel(const floatX* x, const floatX* y, size_t n,
                                                               double* partial) {
    __shared__ double sums[2][kDiffThreads];
    double d = 0, r = 0;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        const double a = double(float(x[i])), b = double(float(y[i]));
        d += (a - b) * (a - b);
        r += b * b;
    }
    sums[0][threadIdx.x] = d;
    sums[1][threadIdx.x] = r;
    __syncthreads();
    for (int half = kDiffThreads / 2; half > 0; half /= 2) {
        if (int(threadIdx.x) < half) {
            sums[0][threadIdx.x] += sums[0][threadIdx.x + half];
            sums[1][threadIdx.x] += sums[1][threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partial[2 * blockIdx.x] = sums[0][0];
        partial[2 * blockIdx.x + 1] = sums[1][0];
    }
}

// ||x - y|| / ||y|| over n bf16 elements.
double rel_diff(const floatX* x, const floatX* y, size_t n) {
    DeviceBuffer<double> partial(2 * kDiffBlocks);
    sq_diff_kernel<<<kDiffBlocks, kDiffThreads>>>(x, y, n, partial.get());
    cudaCheckLaunch();
    std::vector<double> h(2 * kDiffBlocks);
    cudaCheck(cudaMemcpy(h.data(), partial.get(), partial.bytes(), cudaMemcpyDeviceToHost));
    double d = 0, r = 0;
    for (int b = 0; b < kDiffBlocks; b++) d += h[2 * b], r += h[2 * b + 1];
    return r > 0 ? std::sqrt(d / r) : (d > 0 ? INFINITY : 0.0);
}

// Median ms of --reps runs of fn on stream after --warmup.
template <class Fn>
double median_ms(Fn&& fn, cudaStream_t stream, const Options& o) {
    return llmc::median_ms(stream, o.warmup, o.reps, fn);
}

// The MLP's two GELU places at the sweep's sizes, both ways: the trainer's (matmul_forward with pre_gelu:
// the fc matmul with the GELU_AUX_BIAS epilogue; the fcproj dinp matmul with DGELU, as matmul_backward
// runs it) and a plain matmul (BIAS epilogue; none) followed by our GELU kernel (gelu_forward; the
// gelu_backward above, in place). The two must agree to within bf16 rounding (the epilogue rounds the
// matmul's fp32 result once; the kernel path rounds it, then applies GELU), and the kernel path's
// outputs, poisoned first, must be finite. Prints both times. Returns the number of failed checks.
int run_gelu(const CublasLt& lt, cudaStream_t stream, int64_t N, int C, const Options& o, Counter& counter) {
    const int C4 = 4 * C;
    const size_t n_in = size_t(N) * C, n_out = size_t(N) * C4;
    Case t;  // only its tensors: inputs first, then outputs
    const floatX* inp = t.add_tensor(n_in, next_seed());
    const floatX* w_fc = t.add_tensor(size_t(C4) * C, next_seed());
    const floatX* b_fc = t.add_tensor(size_t(C4), next_seed());
    const floatX* dout = t.add_tensor(n_in, next_seed());   // the fcproj output's gradient (N, C)
    const floatX* w_proj = t.add_tensor(size_t(C) * C4, next_seed());
    floatX* pre = t.add_tensor(n_out, next_seed());
    floatX* out = t.add_tensor(n_out, next_seed());
    floatX* pre2 = t.add_tensor(n_out, next_seed());
    floatX* out2 = t.add_tensor(n_out, next_seed());
    floatX* dinp = t.add_tensor(n_out, next_seed());
    floatX* dinp2 = t.add_tensor(n_out, next_seed());

    auto fwd_epilogue = [&] { matmul_forward(lt, out, inp, w_fc, b_fc, N, C, C4, stream, pre); };
    auto fwd_kernel = [&] {
        matmul_forward(lt, pre2, inp, w_fc, b_fc, N, C, C4, stream);
        gelu_forward(out2, pre2, int64_t(n_out), stream);
    };
    // dinp (N, 4C) = dout (N, C) @ w_proj (C, 4C), through GELU'(pre): matmul_backward's dinp call.
    auto dinp_gemm = [&](floatX* d, cublasLtEpilogue_t epilogue) {
        gemm(lt, stream, N, C4, C, GemmOperand{dout, C, false, 0}, GemmOperand{w_proj, C4, false, 0}, d, CUDA_R_16BF,
             C4, 0, 1, 1.0f, 0.0f, epilogue, nullptr, epilogue == CUBLASLT_EPILOGUE_DGELU ? pre : nullptr, C4);
    };
    auto bwd_epilogue = [&] { dinp_gemm(dinp, CUBLASLT_EPILOGUE_DGELU); };
    auto bwd_kernel = [&] {
        dinp_gemm(dinp2, CUBLASLT_EPILOGUE_DEFAULT);
        gelu_backward(dinp2, pre, dinp2, int64_t(n_out), stream);
    };

    for (floatX* p : {pre, out, pre2, out2, dinp, dinp2}) poison(p, n_out * sizeof(floatX));
    fwd_epilogue();
    fwd_kernel();
    bwd_epilogue();  // both read the epilogue's pre
    bwd_kernel();
    cudaCheck(cudaStreamSynchronize(stream));
    int failures = 0;
    auto check = [&](const char* what, const floatX* got, const floatX* ref) {
        const unsigned long long bad = count_nonfinite(got, n_out, counter);
        const double e = rel_diff(got, ref, n_out);
        const bool ok = bad == 0 && e < kGeluTol;
        std::printf("gelu check: %-44s rel diff %.2e (tol %.0e), %llu non-finite: %s\n", what, e, kGeluTol, bad,
                    ok ? "ok" : "FAIL");
        failures += ok ? 0 : 1;
    };
    check("fc pre-GELU: BIAS matmul vs GELU_AUX_BIAS aux", pre2, pre);
    check("fc out: gelu_forward vs GELU_AUX_BIAS", out2, out);
    check("fcproj dinp: matmul + gelu_backward vs DGELU", dinp2, dinp);

    const double fe = median_ms(fwd_epilogue, stream, o), fk = median_ms(fwd_kernel, stream, o);
    const double be = median_ms(bwd_epilogue, stream, o), bk = median_ms(bwd_kernel, stream, o);
    std::printf("gelu timing (N=%lld, 4C=%d, median ms): fc fwd epilogue %.4f, matmul + kernel %.4f (%.3fx); "
                "fcproj dinp epilogue %.4f, matmul + kernel %.4f (%.3fx)\n",
                (long long)N, C4, fe, fk, fk / fe, be, bk, bk / be);
    return failures;
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&]() -> int {
        Options o;
        if (!parse_args(argc, argv, o)) return 0;
        if (cuda_device_count() == 0) fail(kExitCuda, "matmul_lab needs a GPU");
        cudaDeviceProp prop{};
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        std::printf("device: %s; cuBLASLt %zu; GELU %s\n", prop.name, cublasLtGetVersion(),
                    o.gelu_kernel ? "as its own kernel (fc fwd and fcproj dinp without GELU epilogues)"
                                  : "in the matmuls' epilogues (as the trainer)");

        const CublasLt lt;
        const Stream stream;
        Counter counter;
        const int64_t N = int64_t(o.B) * o.T;
        const int C = o.C, Vp = o.Vp, L = o.layers;
        const bool gelu_epilogue = !o.gelu_kernel;
        // The calls of one forward + backward, in the trainer's order; each case's tensors live only while
        // it runs.
        const std::vector<std::function<Case()>> cases = {
            [&] { return forward_case(lt, stream, "qkv fwd", L, N, C, 3 * C, true, false); },
            [&] { return forward_case(lt, stream, "attproj fwd", L, N, C, C, true, false); },
            [&] { return forward_case(lt, stream, "fc fwd", L, N, C, 4 * C, true, gelu_epilogue); },
            [&] { return forward_case(lt, stream, "fcproj fwd", L, N, 4 * C, C, true, false); },
            [&] { return forward_case(lt, stream, "lm_head fwd", 1, N, C, Vp, false, false); },
            [&] { return dinp_case(lt, stream, "lm_head dinp", 1, N, C, Vp, false); },
            [&] { return dweight_case(lt, stream, "lm_head dweight", 1, N, C, Vp); },
            [&] { return dinp_case(lt, stream, "fcproj dinp", L, N, 4 * C, C, gelu_epilogue); },
            [&] { return dweight_case(lt, stream, "fcproj dweight", L, N, 4 * C, C); },
            [&] { return dinp_case(lt, stream, "fc dinp", L, N, C, 4 * C, false); },
            [&] { return dweight_case(lt, stream, "fc dweight", L, N, C, 4 * C); },
            [&] { return dinp_case(lt, stream, "attproj dinp", L, N, C, C, false); },
            [&] { return dweight_case(lt, stream, "attproj dweight", L, N, C, C); },
            [&] { return dinp_case(lt, stream, "qkv dinp", L, N, C, 3 * C, false); },
            [&] { return dweight_case(lt, stream, "qkv dweight", L, N, C, 3 * C); },
        };
        if (o.sustain_each > 0) {
            for (const auto& make : cases) {
                Case c = make();
                run_sustained_each(lt, c, stream, o);
            }
            return 0;
        }
        if (o.sustain > 0) {
            std::vector<Case> all;
            for (const auto& make : cases) all.push_back(make());
            run_sustained(all, stream, o);
            return 0;
        }
        std::vector<Summary> summaries;
        for (const auto& make : cases) {
            Case c = make();
            summaries.push_back(run_case(lt, stream, c, o, counter));
        }
        std::printf("\n");
        const int gelu_failures = run_gelu(lt, stream, N, C, o, counter);

        std::printf("\nsummary (per step: one forward + backward of B=%d x T=%d, per-layer calls x%d; r0 and best "
                    "re-timed interleaved where they differ)\n",
                    o.B, o.T, L);
        std::printf("%-16s | %9s | %9s | %4s | %4s | %9s | %9s | %6s | %5s | %10s | %10s\n", "call", "sweep r0",
                    "sweep best", "rank", "=r0", "r0 ms", "best ms", "saving", "x", "step r0", "step best");
        double total0 = 0, total_best = 0;
        for (const Summary& s : summaries) {
            if (s.confirm0_ms < 0) {
                std::printf("%-16s | rank 0 skipped, not counted\n", s.name.c_str());
                continue;
            }
            const double step0 = s.confirm0_ms * s.per_step, step_best = s.confirm_best_ms * s.per_step;
            total0 += step0;
            total_best += step_best;
            std::printf("%-16s | %9.4f | %9.4f | %4d | %4s | %9.4f | %9.4f | %5.1f%% | %5d | %10.3f | %10.3f\n",
                        s.name.c_str(), s.rank0_ms, s.best_ms, s.best_rank, s.best_equal ? "yes" : "no", s.confirm0_ms,
                        s.confirm_best_ms, 100.0 * (1.0 - s.confirm_best_ms / s.confirm0_ms), s.per_step, step0,
                        step_best);
        }
        std::printf("%-16s | %9s | %9s | %4s | %4s | %9s | %9s | %6s | %5s | %10.3f | %10.3f\n", "total", "", "", "",
                    "", "", "", "", "", total0, total_best);
        std::printf("matmul time per step (ms): rank 0 %.3f, best %.3f: a possible saving of %.3f ms (%.1f%%) per "
                    "step\n",
                    total0, total_best, total0 - total_best, 100.0 * (1.0 - total_best / total0));
        std::printf("sweep: medians of the table above; r0 ms / best ms: re-timed interleaved (%dx the runs) where the "
                    "sweep's best is not rank 0; =r0: the best's output is bitwise rank 0's\n",
                    kConfirmRounds);
        return gelu_failures == 0 ? 0 : 1;
    });
}
