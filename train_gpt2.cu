/*
GPT-2 training on the GPU (bf16 parameters and activations, fp32 master weights, AdamW).

The trainer is being built (see the README's status section); until then this program prints its
usage and exits, so that the build, the CI and the layout can be relied on by everything else.
*/
#include <cstdio>

#include "llmc/cuda_utils.cuh"

int main(int argc, char** argv) {
    return llmc::run_main([&]() {
        std::printf("usage: %s [options]\n", argc > 0 ? argv[0] : "train_gpt2cu");
        std::printf("The GPU trainer is not built yet; see README.md.\n");
        return argc > 1 ? int(llmc::kExitUsage) : int(llmc::kExitOk);
    });
}
