/*
A training run's record, shared by both trainers: log.jsonl (one JSON object per line, appended by a
resumed run) and the small formatting helpers the step lines use.

The records the trainers write, one per line (scripts/plot.py reads them):
  {"step":S,"loss":L,"lr":X,"norm":N,"ms":M,"tok_per_s":R,"mfu":F}   after each optimizer step S (from 1)
  {"step":S,"val_loss":L}                                             validation before step S+1
  {"step":S,"eval_acc":A,"eval_acc_norm":A,"eval_items":N,"eval_s":X} multiple-choice evaluation
  {"step":S,"sample":[ids...]}                                        a sample's generated token ids
  {"step":S,"skipped":"what was not finite"}                          an update skipped by the guard
  {"step":S,"stopped":"why"}                                          stopped early (signal, --time-limit)
  {"resume_from_step":S}                                              a resumed run continues here
Losses go out with 17 significant digits, so that a double reads back exactly and logs compare bitwise.

Does not provide: stdout formatting of the step line (each trainer prints its own).
*/
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "llmc/utils.h"

namespace llmc {

class JsonlLog {
public:
    JsonlLog() = default;
    // append: continue an existing log (a resumed run) rather than start a new one.
    JsonlLog(const std::string& path, bool append) {
        if (append && regular_file_exists(path)) {
            file_.open(path, File::Mode::ReadWrite);
            const int64_t size = file_.size();
            file_.seek(size);
            // A run killed mid-line leaves a partial record; the next one starts on a line of its own.
            char last = '\n';
            if (size > 0) file_.read_exact_at(&last, 1, size - 1);
            if (last != '\n') file_.write_all("\n", 1);
        } else {
            file_.open(path, File::Mode::Write);
        }
    }
    void write(const std::string& line) {
        if (!file_.is_open()) return;
        std::string l = line + "\n";
        file_.write_all(l.data(), l.size());
    }

private:
    File file_;
};

// JSON has no NaN or infinity; such values go out as null.
inline std::string json_number(double v, const char* fmt = "%.6g") {
    return std::isfinite(v) ? format(fmt, v) : std::string("null");
}

inline std::string json_ids(const std::vector<uint32_t>& ids) {
    std::string out = "[";
    for (size_t i = 0; i < ids.size(); i++) out += format(i ? ",%u" : "%u", ids[i]);
    return out + "]";
}

inline std::string duration_text(double seconds) {
    if (!(seconds >= 0) || !std::isfinite(seconds)) return "?";
    long s = long(seconds + 0.5);
    if (s >= 3600) return format("%ldh%02ldm", s / 3600, (s / 60) % 60);
    if (s >= 60) return format("%ldm%02lds", s / 60, s % 60);
    return format("%lds", s);
}

}  // namespace llmc
