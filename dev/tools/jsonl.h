/*
The JSONL the tools read. jsonl_document_text(): one line of prepare_data's input, parsed as a JSON object,
its text field's string; anything else (not JSON, a number out of range, not an object, the field missing
or not a string) raises kExitData naming path:line (the caller skips blank lines and cuts the file into
lines). With LLMC_TOKENIZER_ENCODER, read_hellaswag_jsonl(): prepare_eval's reader of HellaSwag's own
JSONL, encoded as llm.c does, into a multiple-choice set (llmc/mc_eval.h).
*/
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "llmc/utils.h"

namespace llmc {

inline std::string jsonl_document_text(std::string_view line, const std::string& path, long long line_no,
                                       const std::string& text_field) {
    nlohmann::json doc;
    try {
        doc = nlohmann::json::parse(line.begin(), line.end());
    } catch (const nlohmann::json::exception& e) {
        // The library's message starts "[json.exception.parse_error.101] parse error at line 1, column 5: " or
        // "[json.exception.out_of_range.406] "; the line is ours to give, so keep the column and what follows.
        std::string what = e.what();
        size_t keep = what.find("column ");
        if (keep == std::string::npos) {
            keep = what.find("] ");
            keep = keep == std::string::npos ? 0 : keep + 2;
        }
        fail(kExitData, "%s:%lld: not valid JSON: %s", path.c_str(), line_no, what.c_str() + keep);
    }
    if (!doc.is_object()) {
        fail(kExitData, "%s:%lld: expected a JSON object with a \"%s\" field, got %s", path.c_str(), line_no,
             text_field.c_str(), doc.type_name());
    }
    auto field = doc.find(text_field);
    if (field == doc.end() || !field->is_string()) {
        fail(kExitData, "%s:%lld: expected a string field \"%s\"%s", path.c_str(), line_no, text_field.c_str(),
             field == doc.end() ? ", which this object lacks" : "");
    }
    return std::move(field->get_ref<std::string&>());
}

}  // namespace llmc

// ----------------------------------------------------------------------------------------------------
// HellaSwag's JSONL, for programs that have the encoder.
#ifdef LLMC_TOKENIZER_ENCODER
#include <sstream>

#include "llmc/mc_eval.h"
#include "llmc/tokenizer.h"

namespace llmc {

constexpr size_t kHellaswagEndings = 4;

// One row of HellaSwag's JSONL, as text.
struct HellaswagRow {
    std::string context;
    std::vector<std::string> endings;
    int label = 0;
};

// Parses one line (line_no counts from 1, for the messages).
inline HellaswagRow parse_hellaswag_line(const std::string& line, const std::string& path, int64_t line_no) {
    const char* p = path.c_str();
    const long long ln = (long long)line_no;
    auto bad = [&](const std::string& what) { fail(kExitData, "'%s' line %lld: %s", p, ln, what.c_str()); };
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
        fail(kExitData, "'%s' line %lld is not valid JSON: %s", p, ln, e.what());
    }
    if (!j.is_object()) bad(format("expected a JSON object, found %s", j.type_name()));
    auto string_field = [&](const char* key) {
        const auto& v = j.at(key);
        if (!v.is_string()) bad(format("\"%s\" is %s, expected a string", key, v.type_name()));
        return v.get<std::string>();
    };
    HellaswagRow row;
    if (j.contains("ctx")) {
        row.context = string_field("ctx");
    } else if (j.contains("ctx_a")) {
        // HellaSwag: "If ctx_b is nonempty, then ctx is the same thing as ctx_a, followed by a space, then ctx_b."
        row.context = string_field("ctx_a");
        const std::string b = j.contains("ctx_b") ? string_field("ctx_b") : std::string();
        if (!b.empty()) row.context += " " + b;
    } else {
        bad("no context: expected a \"ctx\" (or \"ctx_a\") string");
    }
    if (row.context.empty()) bad("the context is empty");
    if (!j.contains("endings")) bad("no \"endings\" list");
    const auto& endings = j.at("endings");
    if (!endings.is_array()) bad(format("\"endings\" is %s, expected a list of strings", endings.type_name()));
    // llm.c's eval reader takes only 4 endings.
    if (endings.size() != kHellaswagEndings) {
        bad(format("%zu ending(s); HellaSwag's rows have %zu, the only count llm.c's eval reader takes",
                   endings.size(), kHellaswagEndings));
    }
    for (size_t e = 0; e < endings.size(); e++) {
        if (!endings[e].is_string()) bad(format("ending %zu is %s, expected a string", e, endings[e].type_name()));
        row.endings.push_back(endings[e].get<std::string>());
        if (row.endings.back().empty()) bad(format("ending %zu is empty", e));
    }
    if (!j.contains("label")) bad("no \"label\" (HellaSwag's test split has none; use the val split)");
    const auto& label = j.at("label");
    const std::string text = label.is_string() ? label.get<std::string>() : "";
    long long value = -1;
    if (label.is_number_integer()) {
        value = label.get<long long>();
    } else if (!text.empty() && text.size() < 10 && text.find_first_not_of("0123456789") == std::string::npos) {
        value = std::stoll(text);
    } else {
        bad(format("\"label\" is %s, expected an integer", label.dump().c_str()));
    }
    if (value < 0 || value >= (long long)row.endings.size()) {
        bad(format("label %lld is not one of the %zu endings (0..%zu)", value, row.endings.size(),
                   row.endings.size() - 1));
    }
    row.label = int(value);
    return row;
}

// Every non-blank line of a HellaSwag JSONL file, encoded.
inline McSet read_hellaswag_jsonl(const std::string& path, const Gpt2Encoder& enc) {
    std::istringstream in(read_text_file(path));
    McSet set{path, {}};
    Gpt2Encoder::Context ctx(enc);
    auto encode = [&](const std::string& text) {
        const std::vector<uint32_t> ids = enc.encode_ordinary(ctx, text);
        return std::vector<int32_t>(ids.begin(), ids.end());
    };
    std::string line;
    int64_t line_no = 0;
    while (std::getline(in, line)) {
        line_no++;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        // The eval .bin's limits, checked here so that the message names the line that breaks them.
        if (int64_t(set.items.size()) == kMcMaxExamples) {
            fail(kExitData, "'%s' line %lld: more than %lld rows, the most an eval .bin holds; split the file",
                 path.c_str(), (long long)line_no, (long long)kMcMaxExamples);
        }
        // The row's tokens as llm.c's hellaswag.py makes them: the context as it is, each ending after a space.
        const HellaswagRow row = parse_hellaswag_line(line, path, line_no);
        McItem item{encode(row.context), {}, row.label};
        for (const std::string& e : row.endings) item.endings.push_back(encode(" " + e));
        const int64_t bytes = mc_example_bytes(item);
        if (bytes > kMcMaxExampleBytes) {
            fail(kExitData, "'%s' line %lld: the row encodes to %lld bytes (context of %zu tokens, %zu endings), more "
                 "than the %lld an example of the eval .bin may take", path.c_str(), (long long)line_no,
                 (long long)bytes, item.context.size(), item.endings.size(), (long long)kMcMaxExampleBytes);
        }
        set.items.push_back(std::move(item));
    }
    if (set.items.empty()) fail(kExitData, "'%s' holds no HellaSwag rows", path.c_str());
    return set;
}

}  // namespace llmc
#endif  // LLMC_TOKENIZER_ENCODER
