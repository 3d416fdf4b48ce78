/*
A run's settings, declared once as a list of (key, value, role), and what the trainers derive from it:
- recorded_settings(): what a checkpoint's manifest records (the MustMatch and MayChange ones);
- must_match_keys(): the keys a resume refuses to see changed (they fix shapes, batches, random streams);
  the MayChange ones are reported on resume and apply from the resumed step on;
- settings_hash(): what the ranks of a data-parallel run compare at start-up: every setting, the Ranks
  ones included, since those decide the sequence of collectives (validation, sampling, checkpoints, the
  data's shards).

Does not provide: the settings themselves (each trainer lists its own), or the comparison with a
checkpoint (settings_differences in llmc/checkpoint.h).
*/
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "llmc/hash.h"

namespace llmc {

struct RunSetting {
    enum Role { MustMatch, MayChange, Ranks };
    std::string key, value;
    Role role;
};

inline std::vector<std::pair<std::string, std::string>> recorded_settings(const std::vector<RunSetting>& all) {
    std::vector<std::pair<std::string, std::string>> kv;
    for (const RunSetting& s : all) {
        if (s.role != RunSetting::Ranks) kv.push_back({s.key, s.value});
    }
    return kv;
}

inline std::vector<std::string> must_match_keys(const std::vector<RunSetting>& all) {
    std::vector<std::string> keys;
    for (const RunSetting& s : all) {
        if (s.role == RunSetting::MustMatch) keys.push_back(s.key);
    }
    return keys;
}

// FNV-1a over "key=value;" of every setting, in order.
inline uint64_t settings_hash(const std::vector<RunSetting>& all) {
    std::string text;
    for (const RunSetting& s : all) text += s.key + "=" + s.value + ";";
    return fnv1a64(text);
}

}  // namespace llmc
