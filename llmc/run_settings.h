/*
What the two trainers share about a run's settings: the settings declared once as (key, value, role),
with recorded_settings() (a checkpoint's manifest), must_match_keys() (what a resume refuses to see
changed) and settings_hash() (what data-parallel ranks compare, every setting); and the host memory
check before a run allocates (require_host_memory), against the system, `ulimit -v` and the cgroups.
*/
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

#include "llmc/hash.h"
#include "llmc/utils.h"

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

// Refuses (exit code 1) a run needing more host memory than is available, before it allocates: one line
// with both figures, what the need is made of (what), what limits it, and what to lower (advice). Available
// is the least of MemAvailable, RLIMIT_AS less what is mapped, and each memory cgroup's limit less its
// unreclaimable use (infinity when nothing says).
inline void require_host_memory(double need, const std::string& what, const char* advice) {
    struct {
        double bytes = INFINITY;  // available
        std::string limit;        // what sets it
    } m;
    auto take = [&m](double bytes, std::string limit) {
        if (bytes < m.bytes) m = {std::max(0.0, bytes), std::move(limit)};
    };
    auto read_text = [](const std::string& path) {  // "" when it cannot be read
        std::ifstream f(path);
        return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    };
    auto field = [](const std::string& text, const std::string& key) -> double {  // "key value" lines; -1: none
        std::istringstream in(text);
        std::string k;
        double v;
        while (in >> k >> v) {
            if (k == key) return v;
            in.ignore(1 << 20, '\n');
        }
        return -1;
    };
    const double kib = field(read_text("/proc/meminfo"), "MemAvailable:");
    if (kib >= 0) take(kib * 1024, "MemAvailable in /proc/meminfo");
    struct rlimit rl;
    if (::getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        const double pages = std::strtod(read_text("/proc/self/statm").c_str(), nullptr);  // the first field: size
        const double mapped = pages * double(::sysconf(_SC_PAGESIZE));
        take(double(rl.rlim_cur) - mapped, format("the address-space limit, ulimit -v %llu, less the %s this process "
             "maps already", (unsigned long long)(rl.rlim_cur >> 10), human_bytes(mapped).c_str()));
    }
    // /proc/self/cgroup: "0::PATH" (v2) or "N:...memory...:PATH" (v1), each cgroup up to its mount's root.
    std::istringstream lines(read_text("/proc/self/cgroup"));
    for (std::string line; std::getline(lines, line);) {
        const size_t a = line.find(':'), b = line.find(':', a + 1);
        if (a == std::string::npos || b == std::string::npos) continue;
        const std::string controllers = line.substr(a + 1, b - a - 1);
        const bool v2 = controllers.empty();
        if (!v2 && ("," + controllers + ",").find(",memory,") == std::string::npos) continue;
        const std::string mount = v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
        std::string dir = mount + line.substr(b + 1);
        while (dir.size() > mount.size() && dir.back() == '/') dir.pop_back();
        for (;; dir = dir.substr(0, dir.find_last_of('/'))) {
            const std::string max_file = dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes");
            const double max = std::strtod(read_text(max_file).c_str(), nullptr);  // "max" (none) reads as 0
            if (max > 0 && max < 1e18) {
                double used = 0;
                std::istringstream(read_text(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"))) >> used;
                const double cache = field(read_text(dir + "/memory.stat"), v2 ? "file" : "total_cache");
                take(max - used + std::max(0.0, cache), format("the memory cgroup's limit, %s, less what the cgroup "
                     "holds", max_file.c_str()));
            }
            if (dir.size() <= mount.size()) break;
        }
    }
    if (need <= m.bytes) return;
    fail(kExitError, "the run needs %s of host memory (%s), and %s is available (%s); %s", human_bytes(need).c_str(),
         what.c_str(), human_bytes(m.bytes).c_str(), m.limit.c_str(), advice);
}

}  // namespace llmc
