/*
What a GPT-2 training checkpoint holds, the CPU side: the file names and the two layouts of the
optimizer state, the settings that record a layout, and reading a layout back from a manifest. The
store itself (manifest, checksums, atomic publish, rotation) is llmc/checkpoint.h, which knows nothing
of GPT-2; llmc/gpt2_checkpoint.cuh puts the model's device buffers behind these names.

The two layouts:
  whole:   model.bin (llm.c version 3 header, then the fp32 master weights), params_bf16.bin, adam_m.bin,
           adam_v.bin, each covering all N parameters. Written by one GPU, or by rank 0 when every rank
           holds the whole optimizer state (data parallel without ZeRO-1).
  sharded: model.bin (llm.c version 5 header, then the bf16 parameters), and per rank r master_<r>.bin,
           adam_m_<r>.bin, adam_v_<r>.bin over its owned range, which the settings state_ranks and
           state_shard_<r> ("begin count") record (ZeRO-1: every rank writes its shard).
The bf16 parameters are saved besides the master weights because the stochastic roundings are not a
function of the master weights; a resume needs both to continue bit for bit. The random streams are
functions of (seed, step), so the seeds in the settings are all they need.

Does not provide: device transfers (gpt2_checkpoint.cuh), or the run's settings (the trainer records
them in the manifest through one settings list).
*/
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "llmc/checkpoint.h"
#include "llmc/utils.h"
#include "llmc/zero.h"

namespace llmc {

// The whole layout's files (the sharded layout shares model.bin, with the bf16 parameters in it).
constexpr const char* kCkptModelFile = "model.bin";
constexpr const char* kCkptParamsFile = "params_bf16.bin";
constexpr const char* kCkptAdamMFile = "adam_m.bin";
constexpr const char* kCkptAdamVFile = "adam_v.bin";
// With FP8 fcproj (llmc/gpt2.cuh): the GELU outputs' amax history, in either layout (rank 0's).
constexpr const char* kCkptFp8HistoryFile = "fp8_history.bin";

// The files that hold the optimizer state, per rank in the sharded layout.
enum class StateKind { Master, AdamM, AdamV };

inline std::string state_shard_file(StateKind kind, int rank) {
    const char* stem = kind == StateKind::Master ? "master" : kind == StateKind::AdamM ? "adam_m" : "adam_v";
    return format("%s_%05d.bin", stem, rank);
}

// The settings that describe a layout: a sharded one (the ranges of `layout`), or the whole one (null).
inline std::vector<std::pair<std::string, std::string>> state_layout_settings(const ZeroLayout* layout) {
    if (layout == nullptr) return {{"state_layout", "whole"}};
    std::vector<std::pair<std::string, std::string>> kv = {{"state_layout", "sharded"},
                                                            {"state_ranks", format("%d", layout->world)}};
    for (int r = 0; r < layout->world; r++) {
        const ShardRange o = layout->owned(r);
        kv.push_back({format("state_shard_%d", r), format("%lld %lld", (long long)o.begin, (long long)o.size())});
    }
    return kv;
}

// A checkpoint's layout, read back from its manifest: the files and ranges that hold each array.
struct StateLayout {
    bool sharded = false;
    std::vector<SavedShard> shards;  // sharded: one per saved rank, in rank order
    std::vector<ArraySegment> master, adam_m, adam_v;  // fp32 elements
    ArraySegment params;                               // bf16 elements, all N
};

// Parses the layout of the checkpoint in `dir` (manifest m) for a model of num_params parameters whose
// model-file header is header_bytes long. A checkpoint without the setting is a whole one (the format of
// checkpoints written before sharded ones existed). Raises kExitData naming what is malformed: an unknown
// layout, a missing or bad rank count or range, ranges that do not tile [0, num_params).
inline StateLayout read_state_layout(const std::string& dir, const CheckpointManifest& m, int64_t num_params,
                                     uint64_t header_bytes) {
    StateLayout out;
    const std::string* kind = m.setting("state_layout");
    if (kind && *kind != "whole" && *kind != "sharded") {
        fail(kExitData, "'%s': unknown state_layout '%s'", dir.c_str(), kind->c_str());
    }
    out.sharded = kind && *kind == "sharded";
    if (!out.sharded) {
        out.master = {{kCkptModelFile, header_bytes, 0, num_params}};
        out.adam_m = {{kCkptAdamMFile, 0, 0, num_params}};
        out.adam_v = {{kCkptAdamVFile, 0, 0, num_params}};
        out.params = {kCkptParamsFile, 0, 0, num_params};
        return out;
    }
    const std::string* ranks = m.setting("state_ranks");
    char* end = nullptr;
    const long w = ranks ? std::strtol(ranks->c_str(), &end, 10) : 0;
    if (!ranks || *end != '\0' || w < 1 || w > (1 << 20)) {
        fail(kExitData, "'%s': a sharded checkpoint without a valid state_ranks setting", dir.c_str());
    }
    for (int r = 0; r < int(w); r++) {
        const std::string* range = m.setting(format("state_shard_%d", r));
        long long begin = -1, count = -1;
        char extra = 0;
        if (!range || std::sscanf(range->c_str(), "%lld %lld %c", &begin, &count, &extra) != 2 || begin < 0 ||
            count < 0) {
            fail(kExitData, "'%s': the range of rank %d's shard is missing or malformed", dir.c_str(), r);
        }
        SavedShard s;
        s.path = dir + "/" + state_shard_file(StateKind::Master, r);
        s.rank = r;
        s.world = int(w);
        s.begin = begin;
        s.count = count;
        out.shards.push_back(s);
        out.master.push_back({state_shard_file(StateKind::Master, r), 0, s.begin, s.count});
        out.adam_m.push_back({state_shard_file(StateKind::AdamM, r), 0, s.begin, s.count});
        out.adam_v.push_back({state_shard_file(StateKind::AdamV, r), 0, s.begin, s.count});
    }
    check_saved_shards(out.shards, num_params);
    out.params = {kCkptModelFile, header_bytes, 0, num_params};
    return out;
}

}  // namespace llmc
