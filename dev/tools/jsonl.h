/*
One line of prepare_data's JSONL input: jsonl_document_text() parses it as a JSON object and returns the
document's text, the string in its text field. Anything else (not JSON, a number out of range, not an
object, the field missing or not a string) raises kExitData naming path:line. The caller skips blank lines
and cuts the file into lines; this header reads no files.
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
