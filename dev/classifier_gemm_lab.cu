/*
classifier_gemm_lab: can our own Hopper matmul (llmc/classifier_sm90.cuh) run the classifier's forward
(logits = lnf wte^T: N = B*T rows, Vp columns, C = 768) near cuBLASLt's speed, and with its exponential
epilogue (Y = e^(x - x_t), the lab notes' design) beat cuBLASLt's matmul followed by the softmax pass?

  build/classifier_gemm_lab [--rows 65536] [--C 768] [--V 50257] [--Vp 50304] [--reps 30] [--rounds 3]
                            [--check-rows 48] [--seed 1]

Checks (exit 1 on a failure): on --check-rows rows (first, last, and seeded ones between), every column
against a double-precision reference on the host: the plain matmul within one bf16 step of the exact
logit (plus 1e-4); the exp forward (evaluation form, dloss 0) within 2^-8 + 1e-4 relative of e^(x - c)
with the device's c, 0 at the target and padded columns, s within 1e-4 relative, the loss against the
reference (and fused_classifier's loss on cuBLASLt's bf16 logits, printed beside it); the training form
(dloss > 0): the target column 1 - s and lnf scaled by dloss / s, each within 2^-8. Over the whole tensor,
our plain logits against cuBLASLt's: how many equal bit for bit, and how many differ by more than one
bf16 step plus 1e-4 (must be none).

Timing: CUDA events around each run, --reps runs back to back per variant and --rounds rounds with the
variants interleaved; medians over the rounds after the first. Variants: cuBLASLt's matmul alone
(matmul_forward, what the trainer runs), cuBLASLt + fused_classifier (the trainer's classifier forward,
dlogits written), our plain matmul, our exp forward in its evaluation form, and in its training form
plus backward's one extra pass (d(lnf)'s row scale; lnf restored from a copy before each run, outside the
timed part). Short bursts run at higher clocks than a power-capped training step (performance.md, "the
power cap"), so the training step is the measure that counts.

Inputs: lnf uniform in [-1.73, 1.73] (unit variance, like a LayerNorm output), wte uniform in [-0.1,
0.1] with the padded rows zero (logits of standard deviation ~1.6), targets uniform in [0, V).
*/
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

#include "llmc/classifier.cuh"
#include "llmc/classifier_sm90.cuh"
#include "llmc/cuda_common.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/flags.h"
#include "llmc/matmul.cuh"
#include "llmc/rand.h"
#include "llmc/utils.h"

using namespace llmc;

namespace {

// Over two bf16 tensors: how many elements are equal bit for bit, and how many differ by more than one
// bf16 step of the larger magnitude plus 1e-4 (near 0 the two fp32 sums' own rounding decides).
__global__ void compare_kernel(unsigned long long* counts, const floatX* a, const floatX* b, int64_t n) {
    unsigned long long same = 0, far = 0;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const float x = float(a[i]), y = float(b[i]);
        same += (__bfloat16_as_ushort(a[i]) == __bfloat16_as_ushort(b[i]));
        far += fabsf(x - y) > fmaxf(fabsf(x), fabsf(y)) * (1.0f / 128.0f) * 1.01f + 1e-4f;
    }
    atomicAdd(&counts[0], same);
    atomicAdd(&counts[1], far);
}

// ------------------------------------------------------------------------------------------------
// Host side.

struct Options {
    int rows = 65536;
    int C = 768;
    int V = 50257;
    int Vp = 50304;
    int reps = 30;
    int rounds = 3;
    int check_rows = 48;
    int seed = 1;
};

void fill_uniform(std::vector<floatX>& h, uint64_t seed, float amp) {
    const uint64_t key = rng_key(seed, 0);
    for (size_t i = 0; i < h.size(); i++) {
        const float u = float(rng_u32(key, i) >> 8) * (1.0f / 16777216.0f);
        h[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * amp);
    }
}

float median(std::vector<float> v) {
    if (v.empty()) return 0.0f;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&] {
        Options o;
        Flags flags("classifier_gemm_lab",
                    "Our Hopper matmul for the classifier's forward (plain, and with the exp epilogue) against "
                    "cuBLASLt and cuBLASLt + fused_classifier.");
        flags.add("", "rows", &o.rows, "rows N = B*T (a multiple of 128)", 128, 1 << 22)
            .add("", "C", &o.C, "channels (a multiple of 64)", 64, 1 << 14)
            .add("", "V", &o.V, "vocabulary size", 1, 1 << 22)
            .add("", "Vp", &o.Vp, "padded vocabulary size (a multiple of 64, >= V)", 64, 1 << 22)
            .add("", "reps", &o.reps, "timed runs per variant per round", 1, 100000)
            .add("", "rounds", &o.rounds, "rounds (the first is warm-up)", 2, 1000)
            .add("", "check-rows", &o.check_rows, "rows checked against the host's double-precision reference", 2,
                 1 << 20)
            .add("", "seed", &o.seed, "seed of the inputs", 0, 1 << 30);
        if (!flags.parse(argc, argv)) return 0;
        std::fputs(flags.settings_table().c_str(), stdout);
        if (!classifier90_applies(o.rows, o.C, o.Vp) || o.V > o.Vp) {
            fail(kExitUsage, "classifier_gemm_lab: need --rows a multiple of 128, --C of 64, --Vp of 8, V <= Vp");
        }
        int dev = 0, sms = 0;
        cudaCheck(cudaGetDevice(&dev));
        cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
        if (!classifier90_available()) fail(kExitUsage, "classifier_gemm_lab: needs a build for sm_90a and a compute 9.0 GPU");
        cudaDeviceProp prop{};
        cudaCheck(cudaGetDeviceProperties(&prop, dev));
        std::printf("GPU: %s, %d SMs\n", prop.name, sms);

        const int M = o.rows, K = o.C, V = o.V, Vp = o.Vp;
        std::vector<floatX> h_lnf(size_t(M) * K), h_wte(size_t(Vp) * K);
        fill_uniform(h_lnf, uint64_t(o.seed) * 3 + 1, 1.7320508f);
        fill_uniform(h_wte, uint64_t(o.seed) * 3 + 2, 0.1f);
        for (size_t i = size_t(V) * K; i < h_wte.size(); i++) h_wte[i] = __float2bfloat16_rn(0.0f);
        std::vector<int> h_targets(M);
        {
            const uint64_t key = rng_key(uint64_t(o.seed) * 3 + 3, 0);
            for (int i = 0; i < M; i++) h_targets[i] = int(rng_u32(key, uint64_t(i)) % uint32_t(V));
        }
        DeviceBuffer<floatX> lnf(h_lnf.size()), lnf_work(h_lnf.size()), wte(h_wte.size()), ours(size_t(M) * Vp),
            lt_out(size_t(M) * Vp), dlnf(h_lnf.size());
        DeviceBuffer<int> targets(M);
        DeviceBuffer<float> c(M), partial(classifier90_partial_count(M, Vp)), sums(M), losses(M), lt_losses(M);
        DeviceBuffer<unsigned long long> counts(2);
        cudaCheck(cudaMemcpy(lnf.get(), h_lnf.data(), lnf.bytes(), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(wte.get(), h_wte.data(), wte.bytes(), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(targets.get(), h_targets.data(), targets.bytes(), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemset(dlnf.get(), 0, dlnf.bytes()));
        const Classifier90Scratch scratch{c.get(), partial.get(), sums.get()};
        cudaStream_t stream = nullptr;
        CublasLt lt;
        const float dloss = 1.0f / float(M);

        auto run_plain = [&] { classifier90_logits(ours.get(), lnf.get(), wte.get(), M, K, Vp, stream); };
        // The forward as evaluation runs it (dloss 0: lnf untouched, the target column 0).
        auto run_exp = [&] {
            classifier90_exp_forward(ours.get(), losses.get(), lnf.get(), wte.get(), targets.get(), 0.0f, M, K, V, Vp,
                                     scratch, stream);
        };
        // As training runs it: lnf (a copy, restored before each timed run) scaled, the target column set, and
        // backward's extra pass (d(lnf)'s row scale).
        auto restore = [&] {
            cudaCheck(cudaMemcpyAsync(lnf_work.get(), lnf.get(), lnf.bytes(), cudaMemcpyDeviceToDevice, stream));
        };
        auto run_exp_train = [&] {
            classifier90_exp_forward(ours.get(), losses.get(), lnf_work.get(), wte.get(), targets.get(), dloss, M, K, V,
                                     Vp, scratch, stream);
            classifier90_scale_rows(dlnf.get(), sums.get(), dloss, M, K, stream);
        };
        auto run_lt = [&] { matmul_forward(lt, lt_out.get(), lnf.get(), wte.get(), nullptr, M, K, Vp, stream); };
        auto run_lt_ce = [&] {
            run_lt();
            fused_classifier(lt_out.get(), lt_losses.get(), targets.get(), dloss, M, V, Vp, true, stream);
        };

        // ---- checks
        bool ok = true;
        std::vector<int> check;
        {
            const int n = std::min(o.check_rows, M);
            const uint64_t key = rng_key(uint64_t(o.seed) * 3 + 4, 0);
            for (int i = 0; i < n; i++) {
                if (i < n / 3) check.push_back(i);
                else if (i < 2 * n / 3) check.push_back(M - 1 - (i - n / 3));
                else check.push_back(int(rng_u32(key, uint64_t(i)) % uint32_t(M)));
            }
        }
        std::vector<std::vector<double>> exact(check.size(), std::vector<double>(Vp));
#pragma omp parallel for schedule(dynamic)
        for (int ci = 0; ci < int(check.size()); ci++) {
            const floatX* x = h_lnf.data() + size_t(check[ci]) * K;
            std::vector<double> xd(K);
            for (int k = 0; k < K; k++) xd[k] = double(float(x[k]));
            for (int v = 0; v < Vp; v++) {
                const floatX* w = h_wte.data() + size_t(v) * K;
                double acc = 0.0;
                for (int k = 0; k < K; k++) acc += xd[k] * double(float(w[k]));
                exact[ci][v] = acc;
            }
        }
        std::vector<floatX> row(Vp);
        auto fetch_row = [&](const floatX* base, int r) {
            cudaCheck(cudaMemcpy(row.data(), base + size_t(r) * Vp, size_t(Vp) * sizeof(floatX), cudaMemcpyDeviceToHost));
        };

        // plain
        cudaCheck(cudaMemset(ours.get(), 0xff, ours.bytes()));  // NaN poison: an unwritten element shows
        run_plain();
        run_lt();
        cudaCheck(cudaDeviceSynchronize());
        {
            double worst = 0.0;
            long bad = 0;
            for (size_t ci = 0; ci < check.size(); ci++) {
                fetch_row(ours.get(), check[ci]);
                for (int v = 0; v < Vp; v++) {
                    const double e = exact[ci][v], g = double(float(row[v]));
                    const double tol = std::fabs(e) / 128.0 + 1e-4;
                    const double err = std::fabs(g - e);
                    if (!(err <= tol)) bad++;
                    worst = std::max(worst, std::isfinite(err) ? err / tol : 1e30);
                }
            }
            std::printf("plain: %zu rows x %d columns against the double reference: %ld outside one bf16 step + 1e-4 "
                        "(worst %.3f of the tolerance)\n",
                        check.size(), Vp, bad, worst);
            ok = ok && bad == 0;
            cudaCheck(cudaMemset(counts.get(), 0, counts.bytes()));
            compare_kernel<<<sms * 8, 256>>>(counts.get(), ours.get(), lt_out.get(), int64_t(M) * Vp);
            cudaCheckLaunch();
            unsigned long long hc[2];
            cudaCheck(cudaMemcpy(hc, counts.get(), sizeof(hc), cudaMemcpyDeviceToHost));
            const double total = double(M) * Vp;
            std::printf("plain against cuBLASLt's logits, all %.0f elements: %.4f%% bitwise equal, %llu more than one bf16 "
                        "step + 1e-4 apart\n",
                        total, 100.0 * double(hc[0]) / total, hc[1]);
            ok = ok && hc[1] == 0;
        }
        // exp
        cudaCheck(cudaMemset(ours.get(), 0xff, ours.bytes()));
        run_exp();
        run_lt_ce();
        cudaCheck(cudaDeviceSynchronize());
        {
            std::vector<float> hc(M), hs(M), hl(M), hll(M);
            cudaCheck(cudaMemcpy(hc.data(), c.get(), c.bytes(), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(hs.data(), sums.get(), sums.bytes(), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(hl.data(), losses.get(), losses.bytes(), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(hll.data(), lt_losses.get(), lt_losses.bytes(), cudaMemcpyDeviceToHost));
            long bad_y = 0, bad_zero = 0, bad_s = 0;
            double worst_y = 0.0, worst_s = 0.0, worst_loss = 0.0, worst_lt_loss = 0.0;
            for (size_t ci = 0; ci < check.size(); ci++) {
                const int r = check[ci], t = h_targets[r];
                fetch_row(ours.get(), r);
                double s_ref = 1.0, lse_max = -1e300;
                for (int v = 0; v < V; v++) lse_max = std::max(lse_max, exact[ci][v]);
                double lse = 0.0;
                for (int v = 0; v < V; v++) lse += std::exp(exact[ci][v] - lse_max);
                const double loss_ref = std::log(lse) + lse_max - exact[ci][t];
                for (int v = 0; v < Vp; v++) {
                    const double g = double(float(row[v]));
                    if (v == t || v >= V) {
                        if (g != 0.0) bad_zero++;
                        continue;
                    }
                    const double e = std::exp(exact[ci][v] - double(hc[r]));
                    s_ref += e;
                    const double err = std::fabs(g - e), tol = e * (1.0 / 256.0 + 1e-4) + 1e-30;
                    if (!(err <= tol)) bad_y++;
                    worst_y = std::max(worst_y, std::isfinite(err) ? err / tol : 1e30);
                }
                const double es = std::fabs(double(hs[r]) - s_ref) / s_ref;
                if (!(es <= 1e-4)) bad_s++;
                worst_s = std::max(worst_s, es);
                worst_loss = std::max(worst_loss, std::fabs(double(hl[r]) - loss_ref));
                worst_lt_loss = std::max(worst_lt_loss, std::fabs(double(hll[r]) - loss_ref));
            }
            std::printf("exp: %zu rows: %ld values outside 2^-8 + 1e-4 of e^(x - c) (worst %.3f of the tolerance), %ld "
                        "target or padded columns not 0, %ld row sums outside 1e-4 relative (worst %.2e)\n",
                        check.size(), bad_y, worst_y, bad_zero, bad_s, worst_s);
            std::printf("loss against the double reference, worst of the checked rows: ours %.3e, fused_classifier on "
                        "cuBLASLt's bf16 logits %.3e\n",
                        worst_loss, worst_lt_loss);
            double worst_pair = 0.0;
            for (int r = 0; r < M; r++) worst_pair = std::max(worst_pair, double(std::fabs(hl[r] - hll[r])));
            std::printf("loss, ours against fused_classifier's, all %d rows: worst difference %.3e\n", M, worst_pair);
            ok = ok && bad_y == 0 && bad_zero == 0 && bad_s == 0 && worst_loss < 1e-3;
        }
        // The training form: the same Y but for the target column (1 - s, rounded), lnf scaled by dloss / s.
        restore();
        run_exp_train();
        cudaCheck(cudaDeviceSynchronize());
        {
            std::vector<float> hs(M);
            cudaCheck(cudaMemcpy(hs.data(), sums.get(), sums.bytes(), cudaMemcpyDeviceToHost));
            std::vector<floatX> hx(K);
            long bad = 0;
            for (size_t ci = 0; ci < check.size(); ci++) {
                const int r = check[ci], t = h_targets[r];
                floatX yt;
                cudaCheck(cudaMemcpy(&yt, ours.get() + size_t(r) * Vp + t, sizeof(floatX), cudaMemcpyDeviceToHost));
                const double want_t = 1.0 - double(hs[r]);
                if (!(std::fabs(double(float(yt)) - want_t) <= std::fabs(want_t) / 256.0 + 1e-6)) bad++;
                cudaCheck(cudaMemcpy(hx.data(), lnf_work.get() + size_t(r) * K, K * sizeof(floatX), cudaMemcpyDeviceToHost));
                const double scale = double(dloss) / double(hs[r]);
                for (int k = 0; k < K; k++) {
                    const double want = double(float(h_lnf[size_t(r) * K + k])) * scale;
                    if (!(std::fabs(double(float(hx[k])) - want) <= std::fabs(want) / 256.0 + 1e-30)) bad++;
                }
            }
            std::printf("exp, training form: %zu rows: %ld target columns or scaled lnf values off by more than 2^-8\n",
                        check.size(), bad);
            ok = ok && bad == 0;
        }
        if (!ok) {
            std::printf("FAILED: a check above is outside its tolerance\n");
            return 1;
        }

        // ---- timing
        struct Variant {
            const char* name;
            std::function<void()> run;
            std::vector<float> ms;
            bool restore = false;
        };
        std::vector<Variant> variants;
        variants.push_back({"cuBLASLt matmul", run_lt, {}});
        variants.push_back({"cuBLASLt + fused_classifier", run_lt_ce, {}});
        variants.push_back({"ours, plain", run_plain, {}});
        variants.push_back({"ours, exp (evaluation form)", run_exp, {}});
        variants.push_back({"ours, exp (training form, + row scale)", run_exp_train, {}, true});
        std::vector<cudaEvent_t> ev(size_t(2 * o.reps));
        for (auto& e : ev) cudaCheck(cudaEventCreate(&e));
        for (int round = 0; round < o.rounds; round++) {
            for (auto& v : variants) {
                for (int i = 0; i < o.reps; i++) {
                    if (v.restore) restore();
                    cudaCheck(cudaEventRecord(ev[2 * i], stream));
                    v.run();
                    cudaCheck(cudaEventRecord(ev[2 * i + 1], stream));
                }
                cudaCheck(cudaEventSynchronize(ev[2 * o.reps - 1]));
                if (round == 0) continue;
                for (int i = 0; i < o.reps; i++) {
                    float ms = 0.0f;
                    cudaCheck(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
                    v.ms.push_back(ms);
                }
            }
        }
        for (auto& e : ev) cudaCheck(cudaEventDestroy(e));
        const double flop = 2.0 * M * double(Vp) * K;
        std::printf("\n%-40s %10s %10s %10s\n", "variant", "median ms", "TFLOP/s", "vs cuBLASLt");
        const float base = median(variants[0].ms);
        for (auto& v : variants) {
            const float m = median(v.ms);
            std::printf("%-40s %10.3f %10.1f %10.3f\n", v.name, m, flop / (m * 1e-3) / 1e12, m / base);
        }
        return 0;
    });
}
