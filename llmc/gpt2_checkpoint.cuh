/*
What a GPT-2 training checkpoint holds, the device side: the model's buffers behind the file names and
layouts of llmc/gpt2_checkpoint.h, restoring them (re-sharding the optimizer state when the number of
ranks or the layout changed), and the model file a run writes at the end.

- checkpoint_tensors(model): this rank's part of a checkpoint, in file order, for Checkpointer::save (with
  FP8 fcproj also its amax history, fp8_history.bin, which a bitwise resume needs).
- checkpoint_layout_settings(model): the manifest settings that record the layout.
- load_checkpoint(model, dir, manifest, io): the inverse, from a checkpoint written in either layout by
  any number of ranks (an FP8 amax history of another mode's shape is left out, with a note).
- write_trained_model(model, path, io): the fp32 master weights as an llm.c version 3 file, written through a
  temporary name so that a reader never sees half a file.
- export_trained_model(model, path, format, options): any format of llmc/model_io.h (Hugging Face folders,
  llm.c version 5): the fp32 formats hold the master weights, the bf16 ones the bf16 parameters the model
  computes with (so their loss is the model's own).

Does not provide: the store (llmc/checkpoint.h, llmc/checkpoint.cuh: manifest, checksums, atomic
publish, rotation, asynchronous saves), or the run's settings and resume policy (train_gpt2.cu).
*/
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "llmc/checkpoint.cuh"
#include "llmc/cuda_utils.cuh"
#include "llmc/device_file_io.cuh"
#include "llmc/gpt2.cuh"
#include "llmc/gpt2_checkpoint.h"
#include "llmc/model_file.h"
#include "llmc/model_io.h"
#include "llmc/utils.h"

namespace llmc {

inline std::vector<char> model_file_header(const GPT2Config& c, int version) {
    int32_t h[kModelHeaderInts];
    make_model_header(c, version, h);
    return std::vector<char>(reinterpret_cast<const char*>(h), reinterpret_cast<const char*>(h) + sizeof(h));
}

namespace gpt2_checkpoint_detail {

// The sharded layout's model.bin: the bf16 parameters (identical on every rank) as an llm.c version 5 file.
inline CheckpointTensor bf16_model_tensor(GPT2& model) {
    return {kCkptModelFile, model_file_header(model.config(), kModelVersionBf16), model.state().params,
            size_t(model.num_parameters()) * sizeof(floatX)};
}

// Rank `rank`'s optimizer-state files in the sharded layout.
inline std::vector<CheckpointTensor> shard_tensors(GPT2& model, int rank) {
    const GPT2::State s = model.state();
    const size_t k = size_t(model.zero_layout().owned(rank).size());
    return {{state_shard_file(StateKind::Master, rank), {}, s.master, k * sizeof(float)},
            {state_shard_file(StateKind::AdamM, rank), {}, s.adam_m, k * sizeof(float)},
            {state_shard_file(StateKind::AdamV, rank), {}, s.adam_v, k * sizeof(float)}};
}

// Written whole or not at all (write_file_atomically): a failed write removes its temporary file and leaves
// an earlier model file as it was; the rename is made durable by syncing the directory.
inline void write_master(const GPT2& model, const std::string& path, DeviceFileIO& io, const float* master) {
    const std::vector<char> h = model_file_header(model.config(), kModelVersionFp32);
    write_file_atomically(path, [&](File& f) {
        f.write_all(h.data(), h.size());
        io.device_to_file(f, master, size_t(model.num_parameters()) * sizeof(float), model.stream());
    });
}

// FP8 fcproj's amax history (GPT2::fp8_history), behind a header naming its shape: "LLMCFP8H", then
// int32 version 2 (version 1, before the LayerNorm outputs had slots, held 2 x layers), slots, entries
// per slot, 0.
inline std::vector<char> fp8_history_header(const GPT2::Fp8History& h) {
    std::vector<char> header(24);
    std::memcpy(header.data(), "LLMCFP8H", 8);
    const int32_t v[4] = {2, h.slots, h.len, 0};
    std::memcpy(header.data() + 8, v, sizeof(v));
    return header;
}

}  // namespace gpt2_checkpoint_detail

// The device state this rank's part of a checkpoint holds, in file order (gpt2_checkpoint.h: the layouts),
// and with FP8 fcproj its amax history (kCkptFp8HistoryFile; rank 0's: every rank's is the same).
inline std::vector<CheckpointTensor> checkpoint_tensors(GPT2& model) {
    using namespace gpt2_checkpoint_detail;
    const GPT2::State s = model.state();
    const size_t n = size_t(model.num_parameters());
    std::vector<CheckpointTensor> t;
    const int rank = model.multi() != nullptr ? model.multi()->rank() : 0;
    if (!model.sharded()) {
        t = {{kCkptModelFile, model_file_header(model.config(), kModelVersionFp32), s.master, n * sizeof(float)},
             {kCkptParamsFile, {}, s.params, n * sizeof(floatX)},
             {kCkptAdamMFile, {}, s.adam_m, n * sizeof(float)},
             {kCkptAdamVFile, {}, s.adam_v, n * sizeof(float)}};
    } else {
        if (rank == 0) t.push_back(bf16_model_tensor(model));
        for (CheckpointTensor& st : shard_tensors(model, rank)) t.push_back(std::move(st));
    }
    const GPT2::Fp8History h = model.fp8_history();
    if (h.device != nullptr && rank == 0) t.push_back({kCkptFp8HistoryFile, fp8_history_header(h), h.device, h.bytes});
    return t;
}

// The manifest settings that describe the layout of checkpoint_tensors() across the ranks.
inline std::vector<std::pair<std::string, std::string>> checkpoint_layout_settings(const GPT2& model) {
    return state_layout_settings(model.sharded() ? &model.zero_layout() : nullptr);
}

// Restores the state a checkpoint (directory dir, manifest m) holds, written in either layout by any
// number of ranks (read_state_layout): when the checkpoint's layout and ranges are this run's, each file
// is streamed straight to the device (every chunk checked); otherwise (a resume on another number of
// ranks, or between the whole and the sharded layout) this rank's range of the master weights and
// moments is assembled from the pieces of the saved files (read_array_range, every chunk checked).
// Returns a description of what was re-sharded, empty when nothing was.
// history_note (when not null) is set to what happened to the FP8 amax history when it was not restored
// bit for bit ("" when it was, or when this run keeps none).
inline std::string load_checkpoint(GPT2& model, const std::string& dir, const CheckpointManifest& m, DeviceFileIO& io,
                                   std::string* history_note = nullptr) {
    using namespace gpt2_checkpoint_detail;
    const std::vector<char> header = model_file_header(model.config(), kModelVersionFp32);
    const int64_t num_params = model.num_parameters();
    const StateLayout saved = read_state_layout(dir, m, num_params, header.size());
    const GPT2::State s = model.state();
    const ShardRange target = model.owned();
    cudaStream_t stream = model.stream();
    // FP8 fcproj's amax history: restored when the checkpoint has one of this run's shape (a run with FP8
    // fcproj wrote it), else empty (the next forward measures): none saved, or another number of slots (the
    // run that saved it had qkv.grad.delayed on and this one not, or the reverse: --fp8 may change on resume).
    const GPT2::Fp8History h = model.fp8_history();
    if (history_note != nullptr) history_note->clear();
    if (h.device != nullptr) {
        const FileRecord* rec = m.file(kCkptFp8HistoryFile);
        const std::vector<char> header = fp8_history_header(h);
        if (rec != nullptr && rec->size != header.size() + h.bytes) {
            model.fp8_history_reset();
            if (history_note != nullptr) {
                *history_note = format("its FP8 amax history (%llu bytes) is another FP8 mode's (this one's: %llu bytes, "
                                       "%d slots): starting with an empty one, so the next step measures its scales",
                                       (unsigned long long)rec->size, (unsigned long long)(header.size() + h.bytes),
                                       h.slots);
            }
        } else if (rec != nullptr) {
            load_checkpoint_tensors(dir, m, {{kCkptFp8HistoryFile, header, h.device, h.bytes}}, io, stream);
            model.fp8_history_loaded();
        } else {
            model.fp8_history_reset();
            if (history_note != nullptr) {
                *history_note = "it has no FP8 amax history (saved without FP8 fcproj): the next step measures its scales";
            }
        }
    }
    // The parameters are whole in both layouts.
    load_checkpoint_tensors(dir, m,
                            {saved.sharded ? bf16_model_tensor(model)
                                           : CheckpointTensor{kCkptParamsFile, {}, s.params,
                                                              size_t(num_params) * sizeof(floatX)}},
                            io, stream);
    if (!saved.sharded && !model.sharded()) {
        std::vector<CheckpointTensor> t = checkpoint_tensors(model);
        t.erase(t.begin() + 1);  // params_bf16.bin: done
        t.erase(std::remove_if(t.begin(), t.end(), [](const CheckpointTensor& x) { return x.file == kCkptFp8HistoryFile; }),
                t.end());  // done above
        load_checkpoint_tensors(dir, m, t, io, stream);
        return "";
    }
    const int rank = model.multi() != nullptr ? model.multi()->rank() : 0;
    if (saved.sharded && model.sharded() && int(saved.shards.size()) == model.zero_layout().world &&
        saved.shards[size_t(rank)].begin == target.begin && saved.shards[size_t(rank)].range().end == target.end) {
        load_checkpoint_tensors(dir, m, shard_tensors(model, rank), io, stream);
        return "";
    }
    // Re-shard: this rank's range from whichever files hold it. A whole checkpoint's model.bin header
    // must be this model's before its weights are trusted.
    if (!saved.sharded) {
        std::vector<char> got(header.size());
        read_array_range(dir, m, {{kCkptModelFile, 0, 0, int64_t(header.size())}}, 1, 0, int64_t(header.size()),
                         [&](uint64_t at, const char* p, size_t len) { std::memcpy(got.data() + at, p, len); });
        if (got != header) fail(kExitData, "'%s/%s': its header differs from this model's", dir.c_str(), kCkptModelFile);
    }
    load_array_range(dir, m, saved.master, sizeof(float), target.begin, target.end, s.master, stream);
    load_array_range(dir, m, saved.adam_m, sizeof(float), target.begin, target.end, s.adam_m, stream);
    load_array_range(dir, m, saved.adam_v, sizeof(float), target.begin, target.end, s.adam_v, stream);
    return format("optimizer state of %s re-sharded to %s",
                  saved.sharded ? format("%zu rank(s)", saved.shards.size()).c_str() : "one whole copy",
                  model.sharded() ? format("rank %d of %d (parameters %lld..%lld)", rank, model.zero_layout().world,
                                           (long long)target.begin, (long long)target.end).c_str()
                                  : "one whole copy");
}

// Writes the fp32 master weights as an llm.c model file (version 3), through a temporary name so a reader
// never sees half a file. With ZeRO-1 every rank must call it (the shards are gathered first); only a
// rank with `write` writes.
inline void write_trained_model(GPT2& model, const std::string& path, DeviceFileIO& io, bool write = true) {
    using namespace gpt2_checkpoint_detail;
    const GPT2::State s = model.state();
    if (!model.sharded()) {
        if (write) write_master(model, path, io, s.master);
        return;
    }
    const ZeroLayout& layout = model.zero_layout();
    MultiGpu* multi = model.multi();
    cudaStream_t stream = model.stream();
    DeviceBuffer<float> full{size_t(layout.padded_total())};
    cudaCheck(cudaMemsetAsync(full.get(), 0, full.bytes(), stream));
    cudaCheck(cudaMemcpyAsync(full.get() + layout.shard(multi->rank()).begin, s.master,
                              size_t(layout.shard_size) * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    multi->all_gather_async(full.get(), layout, stream);
    multi->join(stream);
    cudaCheck(cudaStreamSynchronize(stream));
    if (write) write_master(model, path, io, full.get());
}

// The fp32 master weights (master = true; gathered from the ranks with ZeRO-1, where every rank must
// call) or the bf16 parameters, as host floats in file order.
inline std::vector<float> host_parameters(GPT2& model, bool master) {
    const size_t n = size_t(model.num_parameters());
    const GPT2::State s = model.state();
    cudaStream_t stream = model.stream();
    std::vector<float> out(n);
    if (master) {
        if (!model.sharded()) {
            cudaCheck(cudaMemcpyAsync(out.data(), s.master, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
        } else {
            const ZeroLayout& layout = model.zero_layout();
            MultiGpu* multi = model.multi();
            DeviceBuffer<float> full{size_t(layout.padded_total())};
            cudaCheck(cudaMemsetAsync(full.get(), 0, full.bytes(), stream));
            cudaCheck(cudaMemcpyAsync(full.get() + layout.shard(multi->rank()).begin, s.master,
                                      size_t(layout.shard_size) * sizeof(float), cudaMemcpyDeviceToDevice, stream));
            multi->all_gather_async(full.get(), layout, stream);
            multi->join(stream);
            cudaCheck(cudaMemcpyAsync(out.data(), full.get(), n * sizeof(float), cudaMemcpyDeviceToHost, stream));
        }
        cudaCheck(cudaStreamSynchronize(stream));
        return out;
    }
    std::vector<floatX> bf16(n);
    cudaCheck(cudaMemcpyAsync(bf16.data(), s.params, n * sizeof(floatX), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    for (size_t i = 0; i < n; i++) out[i] = __bfloat162float(bf16[i]);
    return out;
}

// Writes the trained model in `format` (llmc/model_io.h) at path. With ZeRO-1 every rank must call it for
// the fp32 formats (the master weights are gathered); only a rank with `write` writes.
inline void export_trained_model(GPT2& model, const std::string& path, ModelFormat format, const SaveOptions& options,
                                 bool write = true) {
    const bool fp32 = format == ModelFormat::Llmc || format == ModelFormat::Hf;
    if (!fp32 && !write) return;
    const std::vector<float> params = host_parameters(model, fp32);
    if (write) save_model(path, format, model.config(), params.data(), options);
}

}  // namespace llmc
