/*
The CPU reference GPT-2 (namespace llmc::cpu, templated on float, or double for gradient checks): the
oracle the GPU code is checked against and a way to train tiny models without a GPU.
  - one function pair per layer, usable alone to check a GPU kernel;
  - GPT2<Real>: parameters and gradients as one flat array in param_tensors() order, forward() -> mean
    loss and logits (B, T, Vp), backward(), grad_norm(), AdamW; reserve() allocates up front.
The model: learned positions, pre-LayerNorm blocks (eps 1e-5), causal attention, tanh-GELU MLP of width
4C, final LayerNorm, classifier tied to wte. Softmax and loss over the first V logits only. AdamW with
decoupled weight decay on the weight matrices only, as nanoGPT and llm.c.
Fixed-order reductions: bitwise identical whatever OMP_NUM_THREADS is. Keeps every activation.
*/
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "llmc/gpt2_config.h"
#include "llmc/utils.h"

namespace llmc::cpu {

constexpr double kLayerNormEps = 1e-5;

// ----------------------------------------------------------------------------------------------------
// Layers. N = B * T rows. Backward functions accumulate (+=) into every gradient they write.

// out (B,T,C) = wte[inp] + wpe[t]
template <class Real>
void encoder_forward(Real* out, const int* inp, const Real* wte, const Real* wpe, int B, int T, int C) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            Real* o = out + (int64_t(b) * T + t) * C;
            const Real* e = wte + int64_t(inp[b * T + t]) * C;
            const Real* p = wpe + int64_t(t) * C;
            for (int c = 0; c < C; c++) o[c] = e[c] + p[c];
        }
    }
}

// Sequential on purpose: a token can repeat, and this is O(BTC), negligible next to the matmuls.
template <class Real>
void encoder_backward(Real* dwte, Real* dwpe, const Real* dout, const int* inp, int B, int T, int C) {
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            const Real* d = dout + (int64_t(b) * T + t) * C;
            Real* dw = dwte + int64_t(inp[b * T + t]) * C;
            Real* dp = dwpe + int64_t(t) * C;
            for (int c = 0; c < C; c++) {
                dw[c] += d[c];
                dp[c] += d[c];
            }
        }
    }
}

// out = (x - mean) * rstd * weight + bias over each row of C; mean and rstd are kept for backward.
template <class Real>
void layernorm_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* weight, const Real* bias,
                       int64_t N, int C) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const Real* x = inp + n * C;
        Real m = 0;
        for (int c = 0; c < C; c++) m += x[c];
        m /= C;
        Real var = 0;
        for (int c = 0; c < C; c++) var += (x[c] - m) * (x[c] - m);
        var /= C;
        Real s = Real(1) / std::sqrt(var + Real(kLayerNormEps));
        Real* o = out + n * C;
        for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * weight[c] + bias[c];
        mean[n] = m;
        rstd[n] = s;
    }
}

template <class Real>
void layernorm_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp, const Real* weight,
                        const Real* mean, const Real* rstd, int64_t N, int C) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const Real* x = inp + n * C;
        const Real* d = dout + n * C;
        // dnorm = dout * weight; dx = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
        Real dnorm_mean = 0, dnorm_norm_mean = 0;
        for (int c = 0; c < C; c++) {
            Real norm = (x[c] - mean[n]) * rstd[n];
            Real dnorm = weight[c] * d[c];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= C;
        dnorm_norm_mean /= C;
        Real* dx = dinp + n * C;
        for (int c = 0; c < C; c++) {
            Real norm = (x[c] - mean[n]) * rstd[n];
            Real dnorm = weight[c] * d[c];
            dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd[n];
        }
    }
    // Summing over rows into one C-vector: sequential keeps it simple and deterministic; it is O(NC).
    for (int64_t n = 0; n < N; n++) {
        const Real* x = inp + n * C;
        const Real* d = dout + n * C;
        for (int c = 0; c < C; c++) {
            dweight[c] += (x[c] - mean[n]) * rstd[n] * d[c];
            dbias[c] += d[c];
        }
    }
}

// Rows of inp handled together so that one pass over a weight row serves all of them (cache reuse).
constexpr int64_t kMatmulRowBlock = 8;

// out (N,OC) = inp (N,C) @ weight^T + bias, weight (OC,C) as PyTorch's nn.Linear; bias may be null.
template <class Real>
void matmul_forward(Real* out, const Real* inp, const Real* weight, const Real* bias, int64_t N, int64_t C,
                    int64_t OC) {
    const int64_t blocks = (N + kMatmulRowBlock - 1) / kMatmulRowBlock;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n0 = blk * kMatmulRowBlock, n1 = std::min(N, n0 + kMatmulRowBlock);
        for (int64_t o = 0; o < OC; o++) {
            const Real* w = weight + o * C;
            for (int64_t n = n0; n < n1; n++) {
                const Real* x = inp + n * C;
                Real sum = 0;
#pragma omp simd reduction(+ : sum)
                for (int64_t c = 0; c < C; c++) sum += x[c] * w[c];
                out[n * OC + o] = (bias != nullptr ? bias[o] : Real(0)) + sum;
            }
        }
    }
}

// dinp += dout @ weight; dweight += dout^T @ inp; dbias += column sums of dout (dbias may be null).
template <class Real>
void matmul_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp, const Real* weight,
                     int64_t N, int64_t C, int64_t OC) {
    const int64_t blocks = (N + kMatmulRowBlock - 1) / kMatmulRowBlock;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n0 = blk * kMatmulRowBlock, n1 = std::min(N, n0 + kMatmulRowBlock);
        for (int64_t o = 0; o < OC; o++) {
            const Real* w = weight + o * C;
            for (int64_t n = n0; n < n1; n++) {
                const Real d = dout[n * OC + o];
                Real* dx = dinp + n * C;
#pragma omp simd
                for (int64_t c = 0; c < C; c++) dx[c] += d * w[c];
            }
        }
    }
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < OC; o++) {
        Real* dw = dweight + o * C;
        Real db = 0;
        for (int64_t n = 0; n < N; n++) {
            const Real d = dout[n * OC + o];
            const Real* x = inp + n * C;
#pragma omp simd
            for (int64_t c = 0; c < C; c++) dw[c] += d * x[c];
            db += d;
        }
        if (dbias != nullptr) dbias[o] += db;
    }
}

// Causal self-attention. qkv (B,T,3C) holds q, k, v, head h at columns h*HS of each; att (B,NH,T,T) keeps
// the softmax (zero above the diagonal); out (B,T,C).
template <class Real>
void attention_forward(Real* out, Real* att, const Real* qkv, int B, int T, int C, int NH) {
    const int HS = C / NH;
    const Real scale = Real(1) / std::sqrt(Real(HS));
    const int64_t C3 = 3 * int64_t(C);
#pragma omp parallel for collapse(3) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            for (int t = 0; t < T; t++) {
                const Real* q = qkv + (int64_t(b) * T + t) * C3 + h * HS;
                Real* a = att + ((int64_t(b) * NH + h) * T + t) * T;
                Real maxval = -std::numeric_limits<Real>::infinity();
                for (int t2 = 0; t2 <= t; t2++) {
                    const Real* k = qkv + (int64_t(b) * T + t2) * C3 + C + h * HS;
                    Real dot = 0;
                    for (int i = 0; i < HS; i++) dot += q[i] * k[i];
                    a[t2] = dot * scale;
                    maxval = std::max(maxval, a[t2]);
                }
                Real sum = 0;
                for (int t2 = 0; t2 <= t; t2++) {
                    a[t2] = std::exp(a[t2] - maxval);
                    sum += a[t2];
                }
                for (int t2 = 0; t2 <= t; t2++) a[t2] /= sum;
                for (int t2 = t + 1; t2 < T; t2++) a[t2] = 0;
                Real* o = out + (int64_t(b) * T + t) * C + h * HS;
                for (int i = 0; i < HS; i++) o[i] = 0;
                for (int t2 = 0; t2 <= t; t2++) {
                    const Real* v = qkv + (int64_t(b) * T + t2) * C3 + 2 * C + h * HS;
                    for (int i = 0; i < HS; i++) o[i] += a[t2] * v[i];
                }
            }
        }
    }
}

// One thread owns a (batch, head) pair: no races and no atomics.
template <class Real>
void attention_backward(Real* dqkv, const Real* dout, const Real* qkv, const Real* att, int B, int T, int C, int NH) {
    const int HS = C / NH;
    const Real scale = Real(1) / std::sqrt(Real(HS));
    const int64_t C3 = 3 * int64_t(C);
#pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            std::vector<Real> datt(size_t(T), Real(0));
            for (int t = 0; t < T; t++) {
                const Real* a = att + ((int64_t(b) * NH + h) * T + t) * T;
                const Real* d = dout + (int64_t(b) * T + t) * C + h * HS;
                const Real* q = qkv + (int64_t(b) * T + t) * C3 + h * HS;
                Real* dq = dqkv + (int64_t(b) * T + t) * C3 + h * HS;
                // out = sum_t2 a[t2] v[t2]
                Real a_dot_datt = 0;
                for (int t2 = 0; t2 <= t; t2++) {
                    const Real* v = qkv + (int64_t(b) * T + t2) * C3 + 2 * C + h * HS;
                    Real* dv = dqkv + (int64_t(b) * T + t2) * C3 + 2 * C + h * HS;
                    Real dot = 0;
                    for (int i = 0; i < HS; i++) {
                        dot += d[i] * v[i];
                        dv[i] += a[t2] * d[i];
                    }
                    datt[t2] = dot;
                    a_dot_datt += a[t2] * dot;
                }
                // softmax backward, then the scaled q . k
                for (int t2 = 0; t2 <= t; t2++) {
                    const Real dpre = a[t2] * (datt[t2] - a_dot_datt) * scale;
                    const Real* k = qkv + (int64_t(b) * T + t2) * C3 + C + h * HS;
                    Real* dk = dqkv + (int64_t(b) * T + t2) * C3 + C + h * HS;
                    for (int i = 0; i < HS; i++) {
                        dq[i] += dpre * k[i];
                        dk[i] += dpre * q[i];
                    }
                }
            }
        }
    }
}

// GPT-2's GELU, the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <class Real>
void gelu_forward(Real* out, const Real* inp, int64_t N) {
    const Real s = std::sqrt(Real(2) / Real(3.14159265358979323846));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; i++) {
        const Real x = inp[i];
        out[i] = Real(0.5) * x * (Real(1) + std::tanh(s * (x + Real(0.044715) * x * x * x)));
    }
}

template <class Real>
void gelu_backward(Real* dinp, const Real* inp, const Real* dout, int64_t N) {
    const Real s = std::sqrt(Real(2) / Real(3.14159265358979323846));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; i++) {
        const Real x = inp[i];
        const Real th = std::tanh(s * (x + Real(0.044715) * x * x * x));
        const Real dth = (Real(1) - th * th) * s * (Real(1) + Real(3 * 0.044715) * x * x);
        dinp[i] += (Real(0.5) * (Real(1) + th) + Real(0.5) * x * dth) * dout[i];
    }
}

template <class Real>
void residual_forward(Real* out, const Real* a, const Real* b, int64_t N) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; i++) out[i] = a[i] + b[i];
}

// Softmax over the first V of Vp logits per row, loss = logsumexp - logit[target]; padded probs 0.
template <class Real>
void crossentropy_forward(Real* probs, Real* losses, const Real* logits, const int* targets, int64_t N, int V,
                          int Vp) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const Real* z = logits + n * Vp;
        Real* p = probs + n * Vp;
        Real maxval = -std::numeric_limits<Real>::infinity();
        for (int v = 0; v < V; v++) maxval = std::max(maxval, z[v]);
        // The sum of 50K exponentials in double: in float, small terms are rounded away.
        double sum = 0;
        for (int v = 0; v < V; v++) {
            p[v] = std::exp(z[v] - maxval);
            sum += double(p[v]);
        }
        for (int v = 0; v < V; v++) p[v] = Real(double(p[v]) / sum);
        for (int v = V; v < Vp; v++) p[v] = 0;
        losses[n] = Real(std::log(sum) + double(maxval) - double(z[targets[n]]));
    }
}

// dlogits += dloss * (probs - onehot(target)) on the first V columns; padded columns get nothing.
template <class Real>
void crossentropy_backward(Real* dlogits, const Real* probs, const int* targets, Real dloss, int64_t N, int V,
                           int Vp) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        Real* d = dlogits + n * Vp;
        const Real* p = probs + n * Vp;
        for (int v = 0; v < V; v++) d[v] += dloss * (p[v] - (v == targets[n] ? Real(1) : Real(0)));
    }
}

// ----------------------------------------------------------------------------------------------------
// The model.

// Held in double so that the double model uses exactly the values given; the float model rounds them.
struct AdamW {
    double learning_rate = 0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
    double weight_decay = 0;  // decoupled, matrices only
};

// The factor llm.c multiplies gradients by inside the update when clipping to a maximum global norm.
inline double clip_scale(double grad_norm, double max_norm) {
    return (max_norm > 0 && grad_norm > max_norm) ? max_norm / grad_norm : 1.0;
}

template <class Real>
class GPT2 {
public:
    // Activations of the last forward, kept for backward and for comparison with the GPU.
    struct Activations {
        int B = 0, T = 0;
        std::vector<int> inputs, targets;  // (B,T)
        std::vector<Real> encoded;         // (B,T,C)
        std::vector<Real> ln1, ln1_mean, ln1_rstd;  // (L,B,T,C), (L,B,T), (L,B,T)
        std::vector<Real> qkv;             // (L,B,T,3C)
        std::vector<Real> att;             // (L,B,NH,T,T)
        std::vector<Real> atty, attproj, residual2;  // (L,B,T,C)
        std::vector<Real> ln2, ln2_mean, ln2_rstd;  // (L,B,T,C), (L,B,T), (L,B,T)
        std::vector<Real> fch, fch_gelu;   // (L,B,T,4C)
        std::vector<Real> fcproj, residual3;  // (L,B,T,C)
        std::vector<Real> lnf, lnf_mean, lnf_rstd;  // (B,T,C), (B,T), (B,T)
        std::vector<Real> logits, probs;   // (B,T,Vp)
        std::vector<Real> losses;          // (B,T)
    };

    explicit GPT2(const GPT2Config& config) : config_(config) {
        validate_config(config, kExitUsage, "GPT2");
        tensors_ = param_tensors(config);
        params.assign(size_t(num_parameters(config)), Real(0));
        grads.assign(params.size(), Real(0));
    }

    // Parameters from a flat float array (a model file, or init_parameters), converted to Real.
    GPT2(const GPT2Config& config, const std::vector<float>& flat) : GPT2(config) {
        if (flat.size() != params.size()) {
            fail(kExitUsage, "GPT2: %zu parameters given, the shape %s needs %zu", flat.size(), describe(config).c_str(),
                 params.size());
        }
        std::copy(flat.begin(), flat.end(), params.begin());
    }

    const GPT2Config& config() const { return config_; }
    const ParamTensorInfo& tensor(int i) const { return tensors_[size_t(i)]; }
    // Tensor i, or layer l's part of a per-layer tensor.
    Real* param(int i, int64_t l = 0) { return params.data() + tensors_[size_t(i)].offset + l * layer_numel(i); }
    Real* grad(int i, int64_t l = 0) { return grads.data() + tensors_[size_t(i)].offset + l * layer_numel(i); }
    const Activations& activations() const { return acts_; }

    // Runs the model on inputs (B,T); with targets returns the mean cross-entropy (else NaN). The logits
    // (B,T,Vp) stay in activations().logits.
    double forward(const int* inputs, const int* targets, int B, int T) {
        const GPT2Config& c = config_;
        if (B < 1 || T < 1 || T > c.max_seq_len) {
            fail(kExitUsage, "GPT2 forward: B=%d T=%d, need B >= 1 and 1 <= T <= maxT=%d", B, T, c.max_seq_len);
        }
        check_tokens(inputs, int64_t(B) * T, "input");
        if (targets != nullptr) check_tokens(targets, int64_t(B) * T, "target");
        allocate_activations(B, T);
        Activations& a = acts_;
        a.inputs.assign(inputs, inputs + int64_t(B) * T);
        has_targets_ = targets != nullptr;
        a.targets.assign(targets, has_targets_ ? targets + int64_t(B) * T : targets);

        const int64_t L = c.num_layers, C = c.channels, NH = c.num_heads, N = int64_t(B) * T;
        encoder_forward(a.encoded.data(), a.inputs.data(), param(kWte), param(kWpe), B, T, int(C));
        for (int64_t l = 0; l < L; l++) {
            const Real* residual = l == 0 ? a.encoded.data() : slice(a.residual3, l - 1);
            layernorm_forward(slice(a.ln1, l), slice(a.ln1_mean, l), slice(a.ln1_rstd, l), residual, param(kLn1w, l),
                              param(kLn1b, l), N, int(C));
            matmul_forward(slice(a.qkv, l), slice(a.ln1, l), param(kQkvw, l), param(kQkvb, l), N, C, 3 * C);
            attention_forward(slice(a.atty, l), slice(a.att, l), slice(a.qkv, l), B, T, int(C), int(NH));
            matmul_forward(slice(a.attproj, l), slice(a.atty, l), param(kAttprojw, l), param(kAttprojb, l), N, C, C);
            residual_forward(slice(a.residual2, l), residual, slice(a.attproj, l), N * C);
            layernorm_forward(slice(a.ln2, l), slice(a.ln2_mean, l), slice(a.ln2_rstd, l), slice(a.residual2, l),
                              param(kLn2w, l), param(kLn2b, l), N, int(C));
            matmul_forward(slice(a.fch, l), slice(a.ln2, l), param(kFcw, l), param(kFcb, l), N, C, 4 * C);
            gelu_forward(slice(a.fch_gelu, l), slice(a.fch, l), N * 4 * C);
            matmul_forward(slice(a.fcproj, l), slice(a.fch_gelu, l), param(kFcprojw, l), param(kFcprojb, l), N, 4 * C,
                           C);
            residual_forward(slice(a.residual3, l), slice(a.residual2, l), slice(a.fcproj, l), N * C);
        }
        layernorm_forward(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), slice(a.residual3, L - 1), param(kLnfw),
                          param(kLnfb), N, int(C));
        matmul_forward(a.logits.data(), a.lnf.data(), param(kWte), static_cast<const Real*>(nullptr), N, C,
                       int64_t(c.padded_vocab_size));
        if (!has_targets_) return std::numeric_limits<double>::quiet_NaN();
        crossentropy_forward(a.probs.data(), a.losses.data(), a.logits.data(), a.targets.data(), N, c.vocab_size,
                             c.padded_vocab_size);
        return std::accumulate(a.losses.begin(), a.losses.end(), 0.0) / double(N);
    }

    void zero_grad() { std::fill(grads.begin(), grads.end(), Real(0)); }

    // Allocates now what training on (B, T) batches needs, so a shortage shows before the first step.
    void reserve(int B, int T) {
        allocate_activations(B, T);
        allocate_moments();
    }

    // Host bytes of the activations and their gradients for (B, T) batches.
    static double activation_bytes(const GPT2Config& c, int B, int T) {
        const double L = c.num_layers, NH = c.num_heads, N = double(B) * T, NC = N * c.channels;
        const double reals = NC * (16 + 18 * L) + N * (4 * L + 3) + 3 * N * c.padded_vocab_size + L * NH * N * T;
        return reals * sizeof(Real) + 2 * N * sizeof(int);
    }

    // Adds the gradient of the last forward's mean loss to grads (zero_grad() first unless accumulating).
    void backward() {
        if (acts_.B == 0 || !has_targets_) fail(kExitUsage, "GPT2 backward: needs a forward with targets first");
        const GPT2Config& c = config_;
        Activations& a = acts_;
        const int B = a.B, T = a.T;
        const int64_t L = c.num_layers, C = c.channels, NH = c.num_heads, N = int64_t(B) * T;
        auto zeroed = [](std::vector<Real>& v) {
            std::fill(v.begin(), v.end(), Real(0));
            return v.data();
        };

        crossentropy_backward(zeroed(d_logits_), a.probs.data(), a.targets.data(), Real(1.0 / double(N)), N,
                              c.vocab_size, c.padded_vocab_size);
        matmul_backward(zeroed(d_ln_), grad(kWte), static_cast<Real*>(nullptr), d_logits_.data(), a.lnf.data(),
                        param(kWte), N, C, int64_t(c.padded_vocab_size));
        // d_residual_ carries the gradient of the residual stream down through the layers.
        layernorm_backward(zeroed(d_residual_), grad(kLnfw), grad(kLnfb), d_ln_.data(), slice(a.residual3, L - 1),
                           param(kLnfw), a.lnf_mean.data(), a.lnf_rstd.data(), N, int(C));
        for (int64_t l = L - 1; l >= 0; l--) {
            const Real* residual = l == 0 ? a.encoded.data() : slice(a.residual3, l - 1);
            // residual3 = residual2 + fcproj: both receive d_residual_, which keeps flowing as d residual2.
            matmul_backward(zeroed(d_fch_gelu_), grad(kFcprojw, l), grad(kFcprojb, l), d_residual_.data(),
                            slice(a.fch_gelu, l), param(kFcprojw, l), N, 4 * C, C);
            gelu_backward(zeroed(d_fch_), slice(a.fch, l), d_fch_gelu_.data(), N * 4 * C);
            matmul_backward(zeroed(d_ln_), grad(kFcw, l), grad(kFcb, l), d_fch_.data(), slice(a.ln2, l), param(kFcw, l),
                            N, C, 4 * C);
            layernorm_backward(d_residual_.data(), grad(kLn2w, l), grad(kLn2b, l), d_ln_.data(), slice(a.residual2, l),
                               param(kLn2w, l), slice(a.ln2_mean, l), slice(a.ln2_rstd, l), N, int(C));
            // residual2 = residual + attproj: the same again for the attention half.
            matmul_backward(zeroed(d_atty_), grad(kAttprojw, l), grad(kAttprojb, l), d_residual_.data(),
                            slice(a.atty, l), param(kAttprojw, l), N, C, C);
            attention_backward(zeroed(d_qkv_), d_atty_.data(), slice(a.qkv, l), slice(a.att, l), B, T, int(C), int(NH));
            matmul_backward(zeroed(d_ln_), grad(kQkvw, l), grad(kQkvb, l), d_qkv_.data(), slice(a.ln1, l),
                            param(kQkvw, l), N, C, 3 * C);
            layernorm_backward(d_residual_.data(), grad(kLn1w, l), grad(kLn1b, l), d_ln_.data(), residual,
                               param(kLn1w, l), slice(a.ln1_mean, l), slice(a.ln1_rstd, l), N, int(C));
        }
        encoder_backward(grad(kWte), grad(kWpe), d_residual_.data(), a.inputs.data(), B, T, int(C));
    }

    // The global L2 norm of all gradients, in double over fixed chunks (thread-count independent).
    double grad_norm() const {
        const int64_t n = int64_t(grads.size()), chunk = 1 << 16;
        const int64_t chunks = (n + chunk - 1) / chunk;
        std::vector<double> partial(size_t(chunks), 0.0);
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < chunks; k++) {
            double s = 0;
            for (int64_t i = k * chunk; i < std::min(n, (k + 1) * chunk); i++) s += double(grads[size_t(i)]) * grads[size_t(i)];
            partial[size_t(k)] = s;
        }
        return std::sqrt(std::accumulate(partial.begin(), partial.end(), 0.0));
    }

    // One AdamW step (step from 1) on grads * grad_scale, bias-corrected; weight decay on decayed tensors.
    void update(const AdamW& opt, int step, double grad_scale = 1.0) {
        if (step < 1) fail(kExitUsage, "GPT2 update: step %d, AdamW steps count from 1", step);
        allocate_moments();
        const Real lr = Real(opt.learning_rate), b1 = Real(opt.beta1), b2 = Real(opt.beta2), eps = Real(opt.eps);
        const Real bc1 = Real(1) - std::pow(b1, Real(step)), bc2 = Real(1) - std::pow(b2, Real(step));
        const Real scale = Real(grad_scale);
        for (const ParamTensorInfo& t : tensors_) {
            const Real wd = t.decayed ? Real(opt.weight_decay) : Real(0);
            Real* p = params.data() + t.offset;
            const Real* g = grads.data() + t.offset;
            Real* m = adam_m.data() + t.offset;
            Real* v = adam_v.data() + t.offset;
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < t.numel; i++) {
                const Real gi = g[i] * scale;
                m[i] = b1 * m[i] + (Real(1) - b1) * gi;
                v[i] = b2 * v[i] + (Real(1) - b2) * gi * gi;
                const Real m_hat = m[i] / bc1, v_hat = v[i] / bc2;
                p[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + wd * p[i]);
            }
        }
    }

    std::vector<Real> params, grads, adam_m, adam_v;

private:
    void check_tokens(const int* tokens, int64_t n, const char* what) const {
        const int* bad = std::find_if(tokens, tokens + n, [&](int t) { return t < 0 || t >= config_.vocab_size; });
        if (bad != tokens + n) {
            fail(kExitData, "GPT2 forward: %s token %lld is %d, outside the vocabulary [0, %d)", what,
                 (long long)(bad - tokens), *bad, config_.vocab_size);
        }
    }

    void allocate_moments() {
        if (!adam_m.empty()) return;
        adam_m.assign(params.size(), Real(0));
        adam_v.assign(params.size(), Real(0));
    }

    void allocate_activations(int B, int T) {
        Activations& a = acts_;
        if (a.B == B && a.T == T) return;
        const size_t L = size_t(config_.num_layers), C = size_t(config_.channels), NH = size_t(config_.num_heads);
        const size_t Vp = size_t(config_.padded_vocab_size), N = size_t(B) * size_t(T);
        a = Activations();
        a.B = B;
        a.T = T;
        for (auto* v : {&a.ln1, &a.atty, &a.attproj, &a.residual2, &a.ln2, &a.fcproj, &a.residual3}) v->resize(L * N * C);
        for (auto* v : {&a.ln1_mean, &a.ln1_rstd, &a.ln2_mean, &a.ln2_rstd}) v->resize(L * N);
        for (auto* v : {&a.fch, &a.fch_gelu}) v->resize(L * N * 4 * C);
        a.qkv.resize(L * N * 3 * C);
        a.att.resize(L * size_t(B) * NH * size_t(T) * size_t(T));
        for (auto* v : {&a.encoded, &a.lnf, &d_residual_, &d_ln_, &d_atty_}) v->resize(N * C);
        for (auto* v : {&a.lnf_mean, &a.lnf_rstd, &a.losses}) v->resize(N);
        for (auto* v : {&a.logits, &a.probs, &d_logits_}) v->resize(N * Vp);
        for (auto* v : {&d_fch_, &d_fch_gelu_}) v->resize(N * 4 * C);
        d_qkv_.resize(N * 3 * C);
    }

    // Elements of one layer's part of tensor i.
    int64_t layer_numel(int i) const { return tensors_[size_t(i)].numel / config_.num_layers; }

    // Layer l's part of a per-layer activation.
    Real* slice(std::vector<Real>& v, int64_t l) { return v.data() + l * (int64_t(v.size()) / config_.num_layers); }

    GPT2Config config_;
    std::array<ParamTensorInfo, kNumParamTensors> tensors_;
    Activations acts_;
    bool has_targets_ = false;
    // Gradients of activations, one layer at a time (backward walks the layers down).
    std::vector<Real> d_residual_, d_ln_, d_atty_, d_qkv_, d_fch_, d_fch_gelu_, d_logits_;
};

}  // namespace llmc::cpu
