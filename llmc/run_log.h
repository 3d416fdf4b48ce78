/*
A training run's record, shared by both trainers: log.jsonl (one JSON object per line, appended by a
resumed run; scripts/plot.py reads it), the step lines' formatting helpers, skip_reason, and
save_run_outputs. Records:
  {"step":S,"loss":L,"lr":X,"norm":N,"ms":M,"tok_per_s":R,"mfu":F}   after each optimizer step S (from 1)
  {"step":S,"val_loss":L}                                             validation before step S+1
  {"step":S,"eval_acc":A,"eval_acc_norm":A,"eval_items":N,"eval_s":X} multiple-choice evaluation
  {"step":S,"sample":[ids...]}                                        a sample's generated token ids
  {"step":S,"skipped":"what was not finite"}                          an update skipped by the guard
  {"step":S,"stopped":"why"}                                          stopped early
  {"step":S,"save_failed":"why","earlier_files":[paths...]}           files there that are not this run's
  {"resume_from_step":S}                                              a resumed run continues here
  {"evaluation_of":"MODEL"}                                           a run that trains nothing (-x 0) follows
Train losses have 17 significant digits (exact doubles), validation losses 9.
*/
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <sys/stat.h>

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
        if (file_.is_open()) file_.write_all((line + "\n").data(), line.size() + 1);
    }

private:
    File file_;
};

// A JSON string (quotes, backslashes and control characters escaped).
inline std::string json_string(const std::string& s) {
    std::string out = "\"";
    for (unsigned char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        out += c < 0x20 ? format("\\u%04x", c) : std::string(1, char(c));
    }
    return out + "\"";
}

// The run's log at path: appended to by a resumed run, or by a run that trains nothing after an
// {"evaluation_of":"MODEL"} line when the file holds records; else started afresh.
inline JsonlLog open_run_log(const std::string& path, bool resume, bool no_training, const std::string& model) {
    struct stat st;
    const bool keep = no_training && !resume && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0;
    JsonlLog log(path, resume || keep);
    if (keep) {
        std::printf("note: %s holds an earlier run's records; this run's (-x 0) are appended after them\n", path.c_str());
        log.write(format("{\"evaluation_of\":%s}", json_string(model).c_str()));
    }
    return log;
}

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

// Why the step guard skipped an update: the norm not finite, else a loss not finite, else a loss spike.
inline std::string skip_reason(double norm, bool losses_finite, double loss, double loss_limit) {
    if (!std::isfinite(norm)) return format("the gradient norm is %g", norm);
    if (!losses_finite) return "a loss is not finite";
    return format("the loss %.4f is a spike (limit %.4f)", loss, loss_limit);
}

inline std::string skipped_record(int step, const std::string& why) {
    return format("{\"step\":%d,\"skipped\":%s}", step, json_string(why).c_str());
}

// Writes the trained model's files: write(i) writes paths[i]. When one fails, the files from there on are
// not this run's: the log gets a save_failed record and the error names them.
template <class Write>
void save_run_outputs(JsonlLog& log, int step, const std::vector<std::string>& paths, Write&& write) {
    size_t i = 0;
    try {
        for (; i < paths.size(); i++) write(i);
    } catch (const Error& e) {
        std::string earlier, listed;
        for (size_t k = i; k < paths.size(); k++) {
            struct stat st;
            if (::lstat(paths[k].c_str(), &st) != 0) continue;
            earlier += (earlier.empty() ? "" : ",") + json_string(paths[k]);
            listed += (listed.empty() ? "" : ", ") + paths[k];
        }
        bool logged = true;
        try {  // the space the failed file held is free again, but the error is what matters
            log.write(format("{\"step\":%d,\"save_failed\":%s,\"earlier_files\":[%s]}", step,
                             json_string(e.what()).c_str(), earlier.c_str()));
        } catch (const Error&) {
            logged = false;
        }
        if (listed.empty()) throw;
        fail(e.exit_code(), "%s; so %s %s from before this run, not its result%s", e.what(), listed.c_str(),
             listed.find(", ") == std::string::npos ? "is" : "are",
             logged ? " (log.jsonl's last line says so)" : "");
    }
}

}  // namespace llmc
