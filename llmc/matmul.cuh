/*
Matrix multiplications through cuBLASLt: bf16 inputs and outputs (or fp32 outputs), fp32 accumulation.
  cublasCheck(call): raises an llmc::Error naming the call, file, line and cuBLAS's status.
  CublasLt: owner of a cuBLASLt handle and its workspace (one per stream: a shared workspace would race).
  gemm(): row-major strided-batched D = alpha * op(A) @ op(B) + beta * D with optional epilogues.
  matmul_forward / matmul_backward_dx / _dw: the linear layer, with cpu/gpt2_cpu.h's argument meanings
      (weight (OC, C) as nn.Linear); dinp is OVERWRITTEN, dweight and dbias ADDED to (over micro-batches).
The bias gradient is our own fixed-order two-pass reduction (no atomics: bitwise reproducible).
With tuning on (set_tuning; the trainer always tunes), the first beta = 0 call of each shape, layout and
epilogue times the heuristic's candidates that give the first choice's exact bits (by fingerprint) and
keeps the fastest; those first calls synchronise. beta != 0 calls run the first choice.
*/
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include <cublasLt.h>

#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/utils.h"

namespace llmc {

inline void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
        fail(kExitCuda, "cuBLAS error %s (%s) from %s at %s:%d", cublasLtGetStatusName(status),
             cublasLtGetStatusString(status), call, file, line);
    }
}

#define cublasCheck(call) ::llmc::cublas_check((call), #call, __FILE__, __LINE__)

// 32 MiB is what cuBLAS recommends for Hopper.
constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;

class CublasLt {
public:
    explicit CublasLt(size_t workspace_bytes = kCublasWorkspaceBytes) : workspace_(workspace_bytes) {
        cublasCheck(cublasLtCreate(&handle_));
    }
    CublasLt(const CublasLt&) = delete;
    CublasLt& operator=(const CublasLt&) = delete;
    ~CublasLt() {
        if (handle_) cublasLtDestroy(handle_);
    }
    cublasLtHandle_t handle() const { return handle_; }
    void* workspace() const { return workspace_.get(); }
    size_t workspace_bytes() const { return workspace_.bytes(); }

    // Algorithm tuning (the file's comment): off by default.
    void set_tuning(bool on) { tuning_ = on; }
    bool tuning() const { return tuning_; }

    // What tuning found for one key: the algorithm, its rank, the candidates and how many gave the first
    // choice's bits, and the first choice's and chosen one's time (ms).
    struct Tuned {
        cublasLtMatmulAlgo_t algo{};
        int rank = 0, candidates = 0, same_bits = 0;
        float first_ms = 0, chosen_ms = 0;
    };
    using TuneKey = std::array<int64_t, 24>;
    const std::map<TuneKey, Tuned>& tuned() const { return tuned_; }
    // For gemm(): the cache (tuning happens inside const calls) and a device word for fingerprints.
    std::map<TuneKey, Tuned>& tune_cache() const { return tuned_; }
    unsigned long long* fingerprint_word() const { return fingerprint_.get(); }

private:
    cublasLtHandle_t handle_ = nullptr;
    DeviceBuffer<char> workspace_;
    bool tuning_ = false;
    mutable std::map<TuneKey, Tuned> tuned_;
    DeviceBuffer<unsigned long long> fingerprint_{1};
};

namespace detail {

// Owners of the per-call cuBLASLt descriptors, so that a failing check does not leak them.
struct LtMatmulDesc {
    cublasLtMatmulDesc_t d = nullptr;
    LtMatmulDesc() { cublasCheck(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F)); }
    ~LtMatmulDesc() {
        if (d) cublasLtMatmulDescDestroy(d);
    }
    template <class T>
    void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
        cublasCheck(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
    }
};

struct LtLayout {
    cublasLtMatrixLayout_t l = nullptr;
    LtLayout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int batch, int64_t stride) {
        cublasCheck(cublasLtMatrixLayoutCreate(&l, type, uint64_t(rows), uint64_t(cols), ld));
        if (batch > 1) {
            int32_t count = batch;
            cublasCheck(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
            cublasCheck(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                         sizeof(stride)));
        }
    }
    ~LtLayout() {
        if (l) cublasLtMatrixLayoutDestroy(l);
    }
};

struct LtPreference {
    cublasLtMatmulPreference_t p = nullptr;
    LtPreference() { cublasCheck(cublasLtMatmulPreferenceCreate(&p)); }
    ~LtPreference() {
        if (p) cublasLtMatmulPreferenceDestroy(p);
    }
    template <class T>
    void set(cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(p, attr, &value, sizeof(value)));
    }
};

// The largest power of two up to 256 dividing the address, the leading dimension and the batch stride
// (in bytes): the heuristic assumes 256-byte alignment unless told.
inline uint32_t alignment_bytes(const void* p, int64_t ld, int64_t stride, size_t elem) {
    const uint64_t addr = reinterpret_cast<uintptr_t>(p);
    const uint64_t ld_bytes = uint64_t(ld) * elem, stride_bytes = uint64_t(stride) * elem;
    uint32_t a = 256;
    while (a > elem && (addr % a != 0 || ld_bytes % a != 0 || stride_bytes % a != 0)) a /= 2;
    return a;
}

inline const char* epilogue_name(cublasLtEpilogue_t e) {
    switch (e) {
        case CUBLASLT_EPILOGUE_DEFAULT: return "none";
        case CUBLASLT_EPILOGUE_BIAS: return "bias";
        case CUBLASLT_EPILOGUE_GELU_AUX: return "gelu_aux";
        case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "gelu_aux_bias";
        case CUBLASLT_EPILOGUE_DGELU: return "dgelu";
        default: return "other";
    }
}

}  // namespace detail

// One operand of gemm(): a row-major matrix (or batch, batch_stride elements apart), ld elements between
// rows, transposed when transpose is set.
struct GemmOperand {
    const floatX* ptr = nullptr;
    int64_t ld = 0;
    bool transpose = false;
    int64_t batch_stride = 0;
};

namespace detail {

// The cuBLASLt setup of one gemm() call: heuristics() lists the heuristic's algorithms, best first, and
// run() runs any one of them. Holds the operand pointers, alpha and beta, and lt by reference.
class GemmCall {
public:
    GemmCall(const CublasLt& lt, cudaStream_t stream, int64_t M, int64_t N, int64_t K, GemmOperand a, GemmOperand b,
             void* d, cudaDataType_t d_type, int64_t ldd, int64_t d_stride, int batch, float alpha, float beta,
             cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT, const floatX* bias = nullptr,
             floatX* aux = nullptr, int64_t aux_ld = 0, const void* c = nullptr)
        : lt_(lt), stream_(stream), M_(M), N_(N), K_(K), batch_(batch), a_(a), b_(b), d_(d), c_(c != nullptr ? c : d),
          d_type_(d_type),
          ldd_(ldd), d_stride_(d_stride), alpha_(alpha), beta_(beta), epilogue_(epilogue), has_bias_(bias != nullptr),
          aux_(aux), aux_ld_(aux_ld),
          // Column-major views: a row-major (R, C) buffer with row stride ld is a column-major (C, R) one.
          first_(CUDA_R_16BF, b.transpose ? K : N, b.transpose ? N : K, b.ld, batch, b.batch_stride),
          second_(CUDA_R_16BF, a.transpose ? M : K, a.transpose ? K : M, a.ld, batch, a.batch_stride),
          out_(d_type, N, M, ldd, batch, d_stride) {
        const cublasOperation_t op_first = b.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
        const cublasOperation_t op_second = a.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
        desc_.set(CUBLASLT_MATMUL_DESC_TRANSA, op_first);
        desc_.set(CUBLASLT_MATMUL_DESC_TRANSB, op_second);
        desc_.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
        if (bias != nullptr) {
            require_aligned16(bias, "gemm: bias");
            desc_.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(bias));
        }
        if (aux != nullptr) {
            require_pack_multiple(aux_ld, "gemm: GELU aux leading dimension");
            desc_.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<void*>(aux));
            desc_.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, aux_ld);
        }

        const size_t d_elem = d_type == CUDA_R_32F ? 4 : 2;
        align_first_ = alignment_bytes(b.ptr, b.ld, b.batch_stride, 2);
        align_second_ = alignment_bytes(a.ptr, a.ld, a.batch_stride, 2);
        align_d_ = alignment_bytes(d, ldd, d_stride, d_elem);
        align_c_ = alignment_bytes(c_, ldd, d_stride, d_elem);
        pref_.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t(lt.workspace_bytes()));
        pref_.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_first_);
        pref_.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_second_);
        pref_.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c_);
        pref_.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d_);
    }
    GemmCall(const GemmCall&) = delete;
    GemmCall& operator=(const GemmCall&) = delete;

    // Up to max_results algorithms in the heuristic's order of preference into results; returns how many.
    int heuristics(int max_results, cublasLtMatmulHeuristicResult_t* results) const {
        int found = 0;
        cublasCheck(cublasLtMatmulAlgoGetHeuristic(lt_.handle(), desc_.d, first_.l, second_.l, out_.l, out_.l, pref_.p,
                                                   max_results, results, &found));
        return found;
    }

    // Runs the matmul with algo (one of heuristics()' results) on the call's stream, in lt's workspace.
    void run(const cublasLtMatmulAlgo_t& algo) const {
        cublasCheck(cublasLtMatmul(lt_.handle(), desc_.d, &alpha_, b_.ptr, first_.l, a_.ptr, second_.l, &beta_, c_,
                                   out_.l, d_, out_.l, &algo, lt_.workspace(), lt_.workspace_bytes(), stream_));
    }

    // Everything that decides the heuristic's algorithms and what they compute (alignments, not addresses).
    CublasLt::TuneKey key() const {
        uint32_t alpha_bits, beta_bits;
        std::memcpy(&alpha_bits, &alpha_, 4);
        std::memcpy(&beta_bits, &beta_, 4);
        return {M_, N_, K_, batch_, a_.ld, a_.transpose, a_.batch_stride, b_.ld, b_.transpose, b_.batch_stride,
                int64_t(d_type_), ldd_, d_stride_, int64_t(epilogue_), has_bias_, aux_ != nullptr, aux_ld_,
                align_first_, align_second_, align_d_, alpha_bits, beta_bits, align_c_, c_ != d_};
    }

    // Whether tune() may run this call several times: the output must not feed the result (beta = 0 or
    // C its own buffer), and a kept GELU input is fingerprinted for one problem only.
    bool tunable() const { return (beta_ == 0.0f || c_ != d_) && (aux_ == nullptr || batch_ == 1); }

    // A 64-bit fingerprint of what the call wrote (D, and aux when kept). Synchronises the stream.
    uint64_t fingerprint(unsigned long long* word) const;

    // The fastest of a few runs of algo, in ms (after one run to warm up). Synchronises the stream.
    float time_ms(const cublasLtMatmulAlgo_t& algo) const;

    // gemm()'s error when the heuristic has no algorithm.
    [[noreturn]] void fail_no_algorithm() const {
        fail(kExitCuda,
             "cuBLASLt has no algorithm for M=%lld N=%lld K=%lld batch=%d transA=%d transB=%d D=%s epilogue=%s",
             (long long)M_, (long long)N_, (long long)K_, batch_, int(a_.transpose), int(b_.transpose),
             d_type_ == CUDA_R_32F ? "fp32" : "bf16", epilogue_name(epilogue_));
    }

private:
    const CublasLt& lt_;
    cudaStream_t stream_;
    int64_t M_, N_, K_;
    int batch_;
    GemmOperand a_, b_;
    void* d_;
    const void* c_;  // C: d_ unless the call reads another buffer
    cudaDataType_t d_type_;
    int64_t ldd_, d_stride_;
    float alpha_, beta_;
    cublasLtEpilogue_t epilogue_;
    bool has_bias_;
    const floatX* aux_;
    int64_t aux_ld_;
    uint32_t align_first_ = 0, align_second_ = 0, align_d_ = 0, align_c_ = 0;
    LtMatmulDesc desc_;
    LtLayout first_, second_, out_;
    LtPreference pref_;
};

// Adds a hash of every (index, 16-bit word) pair of x to *sum (integer sums: order-independent).
__global__ void gemm_fingerprint_kernel(const uint16_t* x, int64_t n, unsigned long long* sum) {
    unsigned long long h = 0;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        unsigned long long z = ((unsigned long long)i << 16 | x[i]) + 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        h += z ^ (z >> 31);
    }
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) h += __shfl_xor_sync(0xffffffffu, h, offset);
    if (threadIdx.x % kWarpSize == 0) atomicAdd(sum, h);
}

inline uint64_t GemmCall::fingerprint(unsigned long long* word) const {
    cudaCheck(cudaMemsetAsync(word, 0, sizeof(*word), stream_));
    auto add = [&](const void* p, int64_t words) {
        gemm_fingerprint_kernel<<<264, 256, 0, stream_>>>(static_cast<const uint16_t*>(p), words, word);
        cudaCheckLaunch();
    };
    // D: `batch` problems of M rows, ldd_ elements apart; the last row holds N.
    const int64_t d_elems = int64_t(batch_ - 1) * d_stride_ + (M_ - 1) * ldd_ + N_;
    add(d_, d_elems * (d_type_ == CUDA_R_32F ? 2 : 1));
    if (aux_ != nullptr) add(aux_, (M_ - 1) * aux_ld_ + N_);
    unsigned long long host = 0;
    cudaCheck(cudaMemcpyAsync(&host, word, sizeof(host), cudaMemcpyDeviceToHost, stream_));
    cudaCheck(cudaStreamSynchronize(stream_));
    return host;
}

inline float GemmCall::time_ms(const cublasLtMatmulAlgo_t& algo) const {
    constexpr int kTimedRuns = 3;
    Event start(true), stop(true);
    run(algo);
    float best = 0;
    for (int i = 0; i < kTimedRuns; i++) {
        cudaCheck(cudaEventRecord(start, stream_));
        run(algo);
        cudaCheck(cudaEventRecord(stop, stream_));
        cudaCheck(cudaEventSynchronize(stop));
        float ms = 0;
        cudaCheck(cudaEventElapsedTime(&ms, start, stop));
        if (i == 0 || ms < best) best = ms;
    }
    return best;
}

constexpr int kTuneCandidates = 8;

// The algorithm for `call` when lt has tuning on: looked up, or tuned at the key's first call (leaving D
// as some candidate wrote it; the caller runs the returned algorithm).
inline cublasLtMatmulAlgo_t tuned_algo(const CublasLt& lt, const GemmCall& call) {
    std::map<CublasLt::TuneKey, CublasLt::Tuned>& cache = lt.tune_cache();
    const CublasLt::TuneKey key = call.key();
    const auto it = cache.find(key);
    if (it != cache.end()) return it->second.algo;

    cublasLtMatmulHeuristicResult_t results[kTuneCandidates];
    const int found = call.heuristics(kTuneCandidates, results);
    if (found == 0) call.fail_no_algorithm();
    CublasLt::Tuned t;
    t.algo = results[0].algo;
    t.candidates = found;
    t.same_bits = 1;
    call.run(results[0].algo);
    const uint64_t reference = call.fingerprint(lt.fingerprint_word());
    t.first_ms = t.chosen_ms = call.time_ms(results[0].algo);
    for (int r = 1; r < found; r++) {
        if (results[r].state != CUBLAS_STATUS_SUCCESS || results[r].workspaceSize > lt.workspace_bytes()) continue;
        try {
            call.run(results[r].algo);
        } catch (const Error&) {
            continue;  // offered but refused at run time: not a candidate
        }
        if (call.fingerprint(lt.fingerprint_word()) != reference) continue;
        t.same_bits++;
        const float ms = call.time_ms(results[r].algo);
        if (ms < t.chosen_ms) {
            t.chosen_ms = ms;
            t.algo = results[r].algo;
            t.rank = r;
        }
    }
    cache.emplace(key, t);
    return t.algo;
}

}  // namespace detail

// Row-major D (M,N) = alpha * op(A) (M,K) @ op(B) (K,N) + beta * C for each of `batch` problems, C = D
// unless c is given (then D is written without being read); D bf16 or fp32, ldd elements between rows.
// Epilogues (bf16 D only): BIAS (D += bias over rows), GELU_AUX(_BIAS) (aux = result (+ bias), D =
// GELU(aux)), DGELU (D = result * GELU'(aux)). cuBLASLt is column-major: it computes D^T = op(B)^T op(A)^T.
inline void gemm(const CublasLt& lt, cudaStream_t stream, int64_t M, int64_t N, int64_t K, GemmOperand a,
                 GemmOperand b, void* d, cudaDataType_t d_type, int64_t ldd, int64_t d_stride, int batch, float alpha,
                 float beta, cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT, const floatX* bias = nullptr,
                 floatX* aux = nullptr, int64_t aux_ld = 0, const void* c = nullptr) {
    if (M == 0 || N == 0 || batch == 0) return;
    const detail::GemmCall call(lt, stream, M, N, K, a, b, d, d_type, ldd, d_stride, batch, alpha, beta, epilogue, bias,
                                aux, aux_ld, c);
    if (lt.tuning() && call.tunable()) {
        call.run(detail::tuned_algo(lt, call));
        return;
    }
    cublasLtMatmulHeuristicResult_t first;  // no heap allocation per call: gemm() runs inside the step
    if (call.heuristics(1, &first) == 0) call.fail_no_algorithm();
    call.run(first.algo);
}

// ----------------------------------------------------------------------------------------------------
// Bias gradient: dbias[o] += sum over rows of dout[:, o]: fixed chunks of rows into fp32 partials, then
// the chunks' partials added in a fixed order. No atomics.

constexpr int kBiasGradRowsPerChunk = 256;
constexpr int kBiasGradBlock = 256;                               // 8 warps
constexpr int kBiasGradColumnsPerBlock = kWarpSize * kPackX;      // 256

inline int64_t bias_grad_chunks(int64_t N) { return ceil_div<int64_t>(N, kBiasGradRowsPerChunk); }

// Scratch matmul_backward_dw needs for the bias gradient (0 without a bias).
inline size_t matmul_backward_scratch_bytes(int64_t N, int OC) {
    return size_t(bias_grad_chunks(N)) * size_t(OC) * sizeof(float);
}

static __global__ void __launch_bounds__(kBiasGradBlock)
    bias_grad_partial_kernel(float* partial, const floatX* dout, int64_t N, int OC) {
    __shared__ float sums[kBiasGradBlock / kWarpSize][kBiasGradColumnsPerBlock];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int64_t chunk = blockIdx.y;
    const int c0 = blockIdx.x * kBiasGradColumnsPerBlock + lane * kPackX;
    const int64_t row_end = min(N, (chunk + 1) * kBiasGradRowsPerChunk);
    float acc[kPackX] = {};
    if (c0 < OC) {
        for (int64_t n = chunk * kBiasGradRowsPerChunk + warp; n < row_end; n += kBiasGradBlock / kWarpSize) {
            const PackX d = load128(dout + n * OC + c0);
            for (int k = 0; k < kPackX; k++) acc[k] += float(d[k]);
        }
    }
    for (int k = 0; k < kPackX; k++) sums[warp][lane * kPackX + k] = acc[k];
    __syncthreads();
    const int c = blockIdx.x * kBiasGradColumnsPerBlock + threadIdx.x;
    if (c < OC) {
        float s = 0.0f;
        for (int w = 0; w < kBiasGradBlock / kWarpSize; w++) s += sums[w][threadIdx.x];
        partial[chunk * OC + c] = s;
    }
}

// Pass two: a block per 32 columns, lane = column; warp w adds chunks w, w + 32, ... in order, then warp
// 0 the 32 warps' sums in order. The order depends only on the number of chunks.
constexpr int kBiasGradFinalWarps = 32;

static __global__ void __launch_bounds__(kBiasGradFinalWarps * kWarpSize)
    bias_grad_final_kernel(floatX* dbias, const float* partial, int64_t chunks, int OC) {
    __shared__ float sums[kBiasGradFinalWarps][kWarpSize];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int c = blockIdx.x * kWarpSize + lane;
    const float old = warp == 0 && c < OC ? float(dbias[c]) : 0.0f;  // loaded early, used at the end
    float s = 0.0f;
    if (c < OC) {
#pragma unroll 8
        for (int64_t k = warp; k < chunks; k += kBiasGradFinalWarps) s += partial[k * OC + c];
    }
    sums[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && c < OC) {
        float total = 0.0f;
        for (int w = 0; w < kBiasGradFinalWarps; w++) total += sums[w][lane];
        dbias[c] = __float2bfloat16_rn(old + total);
    }
}

// dbias (OC) += the sum of `chunks` rows of fp32 partial column sums, added as pass two adds
// bias_grad_accumulate's (for kernels that sum rows while writing dout anyway: llmc/flash_attention_sm90.cuh).
inline void bias_grad_from_partials(floatX* dbias, const float* partial, int64_t chunks, int OC, cudaStream_t stream) {
    if (chunks == 0) return;
    bias_grad_final_kernel<<<unsigned(ceil_div(OC, kWarpSize)), kBiasGradFinalWarps * kWarpSize, 0, stream>>>(
        dbias, partial, chunks, OC);
    cudaCheckLaunch();
}

inline void bias_grad_accumulate(floatX* dbias, const floatX* dout, int64_t N, int OC, float* scratch,
                                 size_t scratch_bytes, cudaStream_t stream) {
    if (N == 0) return;
    require_pack_multiple(OC, "bias gradient: OC");
    require_aligned16(dout, "bias gradient: dout");
    if (scratch_bytes < matmul_backward_scratch_bytes(N, OC)) {
        fail(kExitUsage, "bias gradient: scratch of %zu bytes, N=%lld OC=%d needs %zu", scratch_bytes, (long long)N, OC,
             matmul_backward_scratch_bytes(N, OC));
    }
    const int64_t chunks = bias_grad_chunks(N);
    const dim3 grid(unsigned(ceil_div(OC, kBiasGradColumnsPerBlock)), unsigned(chunks));
    bias_grad_partial_kernel<<<grid, kBiasGradBlock, 0, stream>>>(scratch, dout, N, OC);
    cudaCheckLaunch();
    bias_grad_from_partials(dbias, scratch, chunks, OC, stream);
}

// ----------------------------------------------------------------------------------------------------
// The linear layer.

// out (N,OC) = inp (N,C) @ weight (OC,C)^T + bias (may be null). With pre_gelu (N,OC): pre_gelu = that
// and out = GELU(pre_gelu), in one call. With residual (N,OC; not with pre_gelu): out = residual + that,
// summed in fp32 and rounded once; residual may be out itself, or must not overlap it.
inline void matmul_forward(const CublasLt& lt, floatX* out, const floatX* inp, const floatX* weight, const floatX* bias,
                           int64_t N, int C, int OC, cudaStream_t stream, floatX* pre_gelu = nullptr,
                           const floatX* residual = nullptr) {
    if (residual != nullptr && pre_gelu != nullptr) {
        fail(kExitUsage, "matmul_forward: a residual and a GELU output in one call (N=%lld OC=%d)", (long long)N, OC);
    }
    if (residual != nullptr && overlaps_partly<floatX>(residual, out, N * OC)) {
        fail(kExitUsage, "matmul_forward: residual (%p) and out (%p) overlap without being the same rows",
             static_cast<const void*>(residual), static_cast<const void*>(out));
    }
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    if (pre_gelu != nullptr) {
        epilogue = bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    } else if (bias != nullptr) {
        epilogue = CUBLASLT_EPILOGUE_BIAS;
    }
    gemm(lt, stream, N, OC, C, GemmOperand{inp, C, false, 0}, GemmOperand{weight, C, true, 0}, out, CUDA_R_16BF, OC, 0,
         1, 1.0f, residual != nullptr ? 1.0f : 0.0f, epilogue, bias, pre_gelu, OC, residual);
}

// dinp (N,C) = dout (N,OC) @ weight (OC,C), times GELU'(pre_gelu) when given (the DGELU epilogue).
inline void matmul_backward_dx(const CublasLt& lt, floatX* dinp, const floatX* dout, const floatX* weight, int64_t N,
                               int C, int OC, cudaStream_t stream, const floatX* pre_gelu = nullptr) {
    if (N == 0) return;
    const cublasLtEpilogue_t epilogue = pre_gelu != nullptr ? CUBLASLT_EPILOGUE_DGELU : CUBLASLT_EPILOGUE_DEFAULT;
    gemm(lt, stream, N, C, OC, GemmOperand{dout, OC, false, 0}, GemmOperand{weight, C, false, 0}, dinp, CUDA_R_16BF, C,
         0, 1, 1.0f, 0.0f, epilogue, nullptr, const_cast<floatX*>(pre_gelu), C);
}

// The weight and bias gradients: dweight += dout^T inp, dbias += dout's column sums. Reads neither dinp
// nor weight, so it may run on its own stream (GPT2's backward does, with its own CublasLt and scratch).
inline void matmul_backward_dw(const CublasLt& lt, floatX* dweight, floatX* dbias, const floatX* dout, const floatX* inp,
                               int64_t N, int C, int OC, float* scratch, size_t scratch_bytes, cudaStream_t stream) {
    if (N == 0) return;
    gemm(lt, stream, OC, C, N, GemmOperand{dout, OC, true, 0}, GemmOperand{inp, C, false, 0}, dweight, CUDA_R_16BF, C,
         0, 1, 1.0f, 1.0f);
    if (dbias != nullptr) bias_grad_accumulate(dbias, dout, N, OC, scratch, scratch_bytes, stream);
}

}  // namespace llmc
