/*
matmul_backward(): both halves of the linear layer's backward (llmc/matmul.cuh's matmul_backward_dx, then
matmul_backward_dw) in one call, the reference the GPU tests compare with; the model calls the halves.
*/
#pragma once

#include "llmc/matmul.cuh"

namespace llmc {

// Both halves: dinp (may be null), dweight (OC,C) +=, dbias (OC, may be null) +=. scratch:
// matmul_backward_scratch_bytes(N, OC) bytes when dbias is given.
inline void matmul_backward(const CublasLt& lt, floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout,
                            const floatX* inp, const floatX* weight, int64_t N, int C, int OC, float* scratch,
                            size_t scratch_bytes, cudaStream_t stream, const floatX* pre_gelu = nullptr) {
    if (N == 0) return;
    if (dinp != nullptr) matmul_backward_dx(lt, dinp, dout, weight, N, C, OC, stream, pre_gelu);
    matmul_backward_dw(lt, dweight, dbias, dout, inp, N, C, OC, scratch, scratch_bytes, stream);
}

}  // namespace llmc
