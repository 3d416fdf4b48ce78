/*
inspect_checkpoint: is a training checkpoint whole, and what does it hold? For each checkpoint directory
given (or every ckpt_* in an output directory given with --all), reads the manifest, checks every file's
size and every chunk's checksum (llmc/checkpoint.h), checks that every stored fp32 array (master
weights, AdamW moments, FP8 amax history) and bf16 array (parameters) holds only finite values, and prints the step, the
settings and the files. Exit code 0 when every checkpoint passes, 4 (invalid contents) or 3 (I/O) at
the first that does not, with the reason; with --all, also 3 for a directory that does not exist and 4 for
one that holds no checkpoint.
  build/inspect_checkpoint out/ckpt_00001000
  build/inspect_checkpoint --all out
Does not provide: repair, or reading the DataLoader state (the trainer does that on resume).
*/
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/checkpoint.h"
#include "llmc/flags.h"
#include "llmc/model_file.h"
#include "llmc/utils.h"

using namespace llmc;

namespace {

// Counts the non-finite values of a file's payload: fp32 unless its name says bf16 or it is a version 5
// model file (both little-endian, the header of a model file skipped).
int64_t count_non_finite(const std::string& path, int64_t payload_offset, bool bf16) {
    File f(path, File::Mode::Read);
    const int64_t size = f.size();
    const int64_t width = bf16 ? 2 : 4;
    if ((size - payload_offset) % width != 0) {
        fail(kExitData, "'%s': %lld payload bytes are not a whole number of %lld-byte values", path.c_str(),
             (long long)(size - payload_offset), (long long)width);
    }
    std::vector<unsigned char> buf(size_t(1) << 24);
    int64_t bad = 0;
    for (int64_t at = payload_offset; at < size;) {
        const size_t n = size_t(std::min<int64_t>(int64_t(buf.size()), size - at));
        f.read_exact_at(buf.data(), n, at);
        for (size_t i = 0; i < n; i += size_t(width)) {
            float v;
            if (bf16) {
                uint16_t h;
                std::memcpy(&h, buf.data() + i, 2);
                v = bf16_to_float(h);
            } else {
                std::memcpy(&v, buf.data() + i, 4);
            }
            bad += std::isfinite(v) ? 0 : 1;
        }
        at += int64_t(n);
    }
    return bad;
}

void inspect(const std::string& dir, bool quiet) {
    const CheckpointManifest m = validate_checkpoint(dir, /*deep=*/true);
    if (!quiet) std::printf("%s: step %lld, %zu files, checksums ok\n", dir.c_str(), (long long)m.step, m.files.size());
    for (const FileRecord& rec : m.files) {
        const std::string path = dir + "/" + rec.name;
        int64_t offset = 0;
        bool bf16 = rec.name.find("bf16") != std::string::npos;
        if (rec.name == kCkptModelFile) {
            File f(path, File::Mode::Read);
            const ModelFileInfo info = read_model_header(f);
            offset = kModelHeaderBytes;
            bf16 = info.version == kModelVersionBf16;
        }
        if (rec.name == kCkptFp8HistoryFile) {  // FP8 fcproj's amax history: its header, then fp32
            File f(path, File::Mode::Read);
            char magic[8] = {};
            f.read_exact(magic, sizeof(magic));
            if (std::memcmp(magic, kFp8HistoryMagic, 8) != 0) fail(kExitData, "'%s': not an FP8 amax history", path.c_str());
            offset = int64_t(kFp8HistoryHeaderBytes);
        }
        if (rec.name.size() < 4 || rec.name.compare(rec.name.size() - 4, 4, ".bin") != 0) continue;
        const int64_t bad = count_non_finite(path, offset, bf16);
        if (bad > 0) fail(kExitData, "'%s' holds %lld values that are not finite", path.c_str(), (long long)bad);
        if (!quiet) {
            std::printf("  %-24s %12llu bytes, %s, all finite\n", rec.name.c_str(), (unsigned long long)rec.size,
                        bf16 ? "bf16" : "fp32");
        }
    }
    if (!quiet) {
        for (const auto& kv : m.settings) std::printf("  setting %s = %s\n", kv.first.c_str(), kv.second.c_str());
    } else {
        std::printf("%s: ok\n", dir.c_str());  // -q: one line per checkpoint, named or found with --all
    }
}

}  // namespace

int main(int argc, char** argv) {
    return run_main([&]() -> int {
        std::vector<std::string> dirs;
        bool all = false, quiet = false;
        Flags flags("inspect_checkpoint",
                    "Checks training checkpoints (sizes, checksums, finite values) and prints what they hold.");
        flags.add_switch("", "all", &all, "the arguments are output directories: check every ckpt_* in each");
        flags.add_switch("q", "quiet", &quiet, "print one line per checkpoint");
        flags.positional("DIR", &dirs, "checkpoint directories (or output directories with --all)");
        if (!flags.parse(argc, argv)) return kExitOk;
        if (dirs.empty()) fail(kExitUsage, "no checkpoint directory given (--help for usage)");
        int checked = 0;
        for (const std::string& d : dirs) {
            if (!all) {
                inspect(d, quiet);
                checked++;
                continue;
            }
            // A directory that is not there, or holds no checkpoint, is an answer too: a mistyped path or a
            // run that never saved must not pass as "every checkpoint whole".
            if (!directory_exists(d)) fail(kExitIo, "--all: '%s' is not a directory", d.c_str());
            const std::vector<CheckpointEntry> found = list_checkpoints(d);
            if (found.empty()) fail(kExitData, "--all: '%s' holds no checkpoint (no ckpt_<step>/ directory)", d.c_str());
            for (const CheckpointEntry& e : found) {
                inspect(e.path, quiet);
                checked++;
            }
        }
        std::printf("%d checkpoint(s) whole, every value finite\n", checked);
        return kExitOk;
    });
}
