# GPT-2 training in C++17/CUDA.
#   make            build everything (trainer, tools, tests)
#   make test       build, then run every test this machine can run (GPU tests skip without a GPU)
#   make GPU_ARCH=80  build for another GPU generation (default: read from nvidia-smi, else sm_90 + PTX)
#   make CPPFLAGS=-I/path/to/include  find headers elsewhere (e.g. nlohmann/json.hpp without the Debian package)
#   make fuzz       fuzz every reader of outside bytes for FUZZ_SECONDS each (clang + libFuzzer; docs/fuzzing.md)
#
# Sources are found by name, so adding a file needs no edit here:
#   test/test_*.cpp     CPU unit tests (GoogleTest)                    -> build/test_*
#   test/test_*.cu      GPU unit tests (GoogleTest + CUDA)             -> build/test_*
#   test/test_*.sh      script tests (exit 0 pass, 77 skip)            -> run in place
#   test/oracles/*.cpp  what script tests run beside a reference       -> build/*
#   dev/tools/*.cpp     the tools users run (prepare_data, ...)        -> build/*
#   dev/*.cu            GPU benchmarks                                 -> build/*
# A binary that needs extra libraries gets a LDLIBS_<name> line below.

CUDA_HOME ?= /usr/local/cuda
NVCC := $(CUDA_HOME)/bin/nvcc
CXX := g++
BUILD := build

GPU_ARCH ?= $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '. ')
ifeq ($(strip $(GPU_ARCH)),)
GPU_ARCH := 90
endif
# Hopper (90) builds as sm_90a: the wgmma flash-attention kernels (llmc/flash_attention_sm90.cuh) need its
# arch-specific instructions, and LLMC_SM90A tells the host code they were compiled.
ifeq ($(strip $(GPU_ARCH)),90)
GENCODE := -gencode arch=compute_90a,code=[sm_90a,compute_90a] -DLLMC_SM90A=1
else
GENCODE := -gencode arch=compute_$(GPU_ARCH),code=[sm_$(GPU_ARCH),compute_$(GPU_ARCH)]
endif

WARNINGS := -Wall -Wextra -Wno-unused-parameter
CXXFLAGS := -std=c++17 -O3 -g -I. -I$(CUDA_HOME)/include -MMD -MP -fopenmp -pthread $(WARNINGS)
NVCCFLAGS := -std=c++17 -O3 -lineinfo -I. -MMD -MP $(GENCODE) --expt-relaxed-constexpr \
             -Xcompiler "-fopenmp -pthread $(WARNINGS)" -Wno-deprecated-gpu-targets
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -lcudart -lcublasLt -lcublas
HOST_LIBS := -fopenmp -pthread
# gtest_main supplies main() to tests that do not define their own (an archive member is linked only when needed).
GTEST_LIBS := -lgtest_main -lgtest

# PCRE2 (the tokenizer's pre-tokenisation regex) is needed only by the binaries named here; where its
# headers are missing (the GPU machine) they are skipped and can be carried from a machine that has them.
PCRE2_BINARIES := prepare_data prepare_eval test_tokenizer test_mc_eval
LDLIBS_prepare_data := -lpcre2-8
LDLIBS_prepare_eval := -lpcre2-8
LDLIBS_test_tokenizer := -lpcre2-8
LDLIBS_test_mc_eval := -lpcre2-8

# NCCL (multi-GPU communication) is linked only into the binaries that use llmc/multi_gpu.cuh; CUDA_LIBS'
# -L$(CUDA_HOME)/lib64 finds it where CUDA ships it, and the system path where the distribution does.
LDLIBS_test_multi_gpu := -lnccl
# train_gpt2.cu (data parallel) uses it, and so does every program that #includes llmc/gpt2.cuh (also
# through llmc/checkpoint.cuh).
LDLIBS_train_gpt2cu := -lnccl
LDLIBS_test_gpt2_gpu := -lnccl
LDLIBS_test_mc_eval_gpu := -lnccl
LDLIBS_test_checkpoint_gpu := -lnccl
LDLIBS_bench_checkpoint := -lnccl
HAVE_PCRE2 := $(wildcard /usr/include/pcre2.h)
# The trainers encode --prompt "text" when PCRE2 is there; without it they take --prompt-ids only.
ifneq ($(HAVE_PCRE2),)
TRAINER_TEXT := -DLLMC_TOKENIZER_ENCODER
LDLIBS_train_gpt2cu += -lpcre2-8
LDLIBS_train_gpt2 += -lpcre2-8
endif

CPU_TESTS := $(patsubst test/%.cpp,$(BUILD)/%,$(wildcard test/test_*.cpp))
GPU_TESTS := $(patsubst test/%.cu,$(BUILD)/%,$(wildcard test/test_*.cu))
SCRIPT_TESTS := $(wildcard test/test_*.sh)
DEV_BINARIES := $(patsubst dev/tools/%.cpp,$(BUILD)/%,$(wildcard dev/tools/*.cpp)) \
                $(patsubst dev/%.cu,$(BUILD)/%,$(wildcard dev/*.cu))
ORACLES := $(patsubst test/oracles/%.cpp,$(BUILD)/%,$(wildcard test/oracles/*.cpp))
TRAINERS := train_gpt2cu train_gpt2

ifeq ($(HAVE_PCRE2),)
SKIPPED_PCRE2 := $(filter $(addprefix $(BUILD)/,$(PCRE2_BINARIES)),$(CPU_TESTS) $(DEV_BINARIES))
CPU_TESTS := $(filter-out $(SKIPPED_PCRE2),$(CPU_TESTS))
DEV_BINARIES := $(filter-out $(SKIPPED_PCRE2),$(DEV_BINARIES))
endif

ALL := $(TRAINERS) $(DEV_BINARIES) $(ORACLES) $(CPU_TESTS) $(GPU_TESTS)

.PHONY: all test clean data fuzz
all: $(ALL)
ifneq ($(SKIPPED_PCRE2),)
	@echo "note: PCRE2 headers not found (apt-get install libpcre2-dev); not built: $(SKIPPED_PCRE2)"
endif

train_gpt2cu: train_gpt2.cu
	$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) $(TRAINER_TEXT) $< -o $@ $(CUDA_LIBS) $(LDLIBS_train_gpt2cu)

# The CPU trainer (fp32 reference model, OpenMP): the quick start without a GPU.
train_gpt2: train_gpt2_cpu.cpp
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) $(TRAINER_TEXT) $< -o $@ $(HOST_LIBS) $(LDLIBS_train_gpt2)

$(BUILD)/%: test/%.cpp | $(BUILD)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) $< -o $@ $(GTEST_LIBS) $(HOST_LIBS) $(LDLIBS_$*)

$(BUILD)/%: test/%.cu | $(BUILD)
	$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) $< -o $@ $(GTEST_LIBS) $(CUDA_LIBS) $(LDLIBS_$*)

$(BUILD)/%: dev/%.cu | $(BUILD)
	$(NVCC) $(CPPFLAGS) $(NVCCFLAGS) $< -o $@ $(CUDA_LIBS) $(LDLIBS_$*)

$(BUILD)/%: dev/tools/%.cpp | $(BUILD)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) $< -o $@ $(HOST_LIBS) $(LDLIBS_$*)

$(BUILD)/%: test/oracles/%.cpp | $(BUILD)
	$(CXX) $(CPPFLAGS) $(CXXFLAGS) $< -o $@ $(HOST_LIBS) $(LDLIBS_$*)

$(BUILD):
	mkdir -p $@

test: $(ALL)
	@bash test/run_tests.sh $(CPU_TESTS) $(GPU_TESTS) $(SCRIPT_TESTS)

clean:
	rm -rf $(BUILD) $(TRAINERS)

# The quick-start corpus: train/val shards, the tokenizer file and a held-out multiple-choice set in data/
# (scripts/prepare_corpus.sh).
data: $(BUILD)/prepare_data $(BUILD)/prepare_eval
	bash scripts/prepare_corpus.sh

# The fuzz targets (test/fuzz.cpp): one libFuzzer program under AddressSanitizer and UBSan, whose first
# report stops it. Not part of `make`: it needs clang and libFuzzer (clang, libclang-rt-14-dev).
FUZZ_CXX ?= clang++
FUZZ_FLAGS := -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -I. -MMD -MP
ifneq ($(HAVE_PCRE2),)
FUZZ_FLAGS += -DLLMC_TOKENIZER_ENCODER
LDLIBS_fuzz := -lpcre2-8
endif
$(BUILD)/fuzz: test/fuzz.cpp | $(BUILD)
	$(FUZZ_CXX) $(CPPFLAGS) $(FUZZ_FLAGS) $< -o $@ $(LDLIBS_fuzz)

# FUZZ_SECONDS per target (60), FUZZ_JOBS targets at once (1): scripts/fuzz.sh.
fuzz: $(BUILD)/fuzz
	bash scripts/fuzz.sh

-include $(wildcard $(BUILD)/*.d) $(wildcard *.d)
