/*
Shared scaffolding for GPU unit tests: a GoogleTest fixture that skips (with a message) when the
machine has no CUDA GPU, so `make test` passes on CPU-only machines and runs everything on GPU ones.
*/
#pragma once

#include <gtest/gtest.h>

#include "llmc/cuda_utils.cuh"

class GpuTest : public ::testing::Test {
protected:
    void SetUp() override {
        if (llmc::cuda_device_count() == 0) GTEST_SKIP() << "skipped: no CUDA GPU on this machine";
    }
};
