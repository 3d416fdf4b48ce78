/*
What prepare_eval makes multiple-choice sets with, besides its held-out text sets, kept beside the tool
because the trainers only read sets (llmc/mc_eval.h): write_mc_file(), the eval .bin writer, and with
LLMC_TOKENIZER_ENCODER, read_hellaswag_jsonl(), HellaSwag's own JSONL encoded as llm.c does. The tests
and the fuzzer call them too.
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "llmc/mc_eval.h"
#include "llmc/utils.h"

namespace llmc {

// The example's size in bytes in the file format.
inline int64_t mc_example_bytes(const McItem& item) {
    int64_t values = kMcExampleFields + int64_t(item.context.size());
    for (const auto& e : item.endings) values += 1 + int64_t(e.size());
    return 2 * values;
}

// Writes the set in llm.c's eval format, checked first and written whole or not at all.
inline void write_mc_file(const std::string& path, const McSet& set) {
    const std::vector<McItem>& items = set.items;
    if (int64_t(items.size()) > kMcMaxExamples) {
        fail(kExitUsage, "'%s': %zu items, the format holds at most %lld", path.c_str(), items.size(),
             (long long)kMcMaxExamples);
    }
    // Token ids must stay below the delimiter; mc_check_items names the offending item.
    mc_check_items(set, kMcDelimiter);
    int64_t longest = 0;
    std::vector<uint16_t> stream;
    for (size_t i = 0; i < items.size(); i++) {
        const McItem& it = items[i];
        const int64_t bytes = mc_example_bytes(it);
        if (bytes > kMcMaxExampleBytes) {
            fail(kExitUsage, "'%s': item %zu takes %lld bytes (context of %zu tokens, %zu endings), more than the "
                 "format's %lld per example", path.c_str(), i, (long long)bytes, it.context.size(),
                 it.endings.size(), (long long)kMcMaxExampleBytes);
        }
        longest = std::max(longest, bytes);
        stream.insert(stream.end(), {uint16_t(kMcDelimiter), uint16_t(bytes), uint16_t(i), uint16_t(it.label),
                                     uint16_t(it.endings.size()), uint16_t(it.context.size())});
        for (int32_t t : it.context) stream.push_back(uint16_t(t));
        for (const auto& e : it.endings) {
            stream.push_back(uint16_t(e.size()));
            for (int32_t t : e) stream.push_back(uint16_t(t));
        }
    }
    const int32_t header[kMcHeaderInts] = {kMcMagic, kMcVersion, int32_t(items.size()), int32_t(longest)};
    write_file_atomically(path, [&](File& f) {
        f.write_all(header, sizeof(header));
        f.write_all(stream.data(), stream.size() * sizeof(uint16_t));
    });
}

}  // namespace llmc

// ----------------------------------------------------------------------------------------------------
// HellaSwag's JSONL, for programs that have the encoder.
#ifdef LLMC_TOKENIZER_ENCODER
#include <sstream>

#include <nlohmann/json.hpp>

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
