/*
Safetensors files (the Hugging Face tensor format), read and written without Python: an 8-byte
little-endian header length N, N bytes of JSON ({"NAME": {"dtype", "shape", "data_offsets": [BEGIN,
END]}, ..., "__metadata__"}), then the data section (row-major, little-endian).
  - SafetensorsFile: validates the header before trusting a byte (size, strict JSON, dtypes, shapes
    against offsets, no overlap); find() / require() look a tensor up, read_floats() reads F32, F16 or
    BF16 as fp32.
  - SafetensorsWriter: F32 or BF16 tensors (bf16 rounded to nearest even), streamed in declared order.
  - fp16_to_float(), the dtype names and sizes, and parse_json_strictly() (every reader of outside JSON).
Every failure names the file (and tensor): kExitData for malformed or truncated data, kExitIo for I/O.
*/
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "llmc/model_file.h"
#include "llmc/utils.h"

namespace llmc {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian, read as it lies");

// The safetensors library refuses headers above 100 MB; so do we, before allocating one.
constexpr int64_t kSafetensorsMaxHeader = 100'000'000;
constexpr const char* kSafetensorsMetadataKey = "__metadata__";
// JSON nested deeper than this is refused while parsed: deep nesting would cost memory and overflow the
// stack in nlohmann's recursive dump().
constexpr int kJsonMaxDepth = 64;

// Item size in bytes of a dtype name of the format, or 0 for a name the format does not have.
inline int safetensors_item_size(const std::string& dtype) {
    static const std::map<std::string, int> sizes = {
        {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
        {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
        {"F32", 4},  {"I64", 8}, {"U64", 8}, {"F64", 8},     {"C64", 8},
    };
    auto it = sizes.find(dtype);
    return it == sizes.end() ? 0 : it->second;
}

inline bool safetensors_float_dtype(const std::string& dtype) {
    return dtype == "F32" || dtype == "F16" || dtype == "BF16";
}

// IEEE binary16 to fp32, exactly (every half value is a float): subnormals, infinities and NaNs kept.
inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    // Zero or a subnormal: mantissa x 2^-24.
    if (exponent == 0) return std::copysign(std::ldexp(float(mantissa), -24), sign ? -1.0f : 1.0f);
    const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112u) << 23) | (mantissa << 13);
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

// A JSON value as a message shows it: its text, cut short when long (a corrupt header may hold anything).
inline std::string json_excerpt(const nlohmann::json& v) {
    std::string s = v.dump();
    return s.size() <= 80 ? s : s.substr(0, 77) + "...";
}

// nlohmann's message without its "[json.exception.out_of_range.406] " tag, which tells a user nothing.
inline std::string json_error_text(const nlohmann::json::exception& e) {
    const std::string s = e.what();
    const size_t tag_end = s.rfind("[json.exception.", 0) == 0 ? s.find("] ") : std::string::npos;
    return tag_end == std::string::npos ? s : s.substr(tag_end + 2);
}

// JSON text from a file, parsed strictly: besides non-JSON it refuses a NUL byte, a key twice in an
// object, a number beyond double's range and nesting deeper than kJsonMaxDepth. Errors are kExitData
// "<where>: <what>" naming the keys leading there (the outermost called `top_key`); text_offset is where
// the text starts in the file.
inline nlohmann::json parse_json_strictly(const std::string& text, const std::string& where, int64_t text_offset,
                                          const char* top_key = "key") {
    using json = nlohmann::json;
    auto bad = [&](const std::string& what) { fail(kExitData, "%s: %s", where.c_str(), what.c_str()); };
    const size_t nul = text.find('\0');
    if (nul != std::string::npos) {
        bad(format("a NUL byte at offset %lld, which JSON text cannot hold", (long long)(text_offset + int64_t(nul))));
    }
    std::vector<std::string> keys;            // the keys leading to where the parser is
    std::vector<std::set<std::string>> seen;  // the keys of each object the parser is inside
    auto location = [&] {
        std::string s;
        for (size_t i = 0; i < keys.size(); i++) {
            s += format("%s%s '%s'", i ? ", " : "", i ? "key" : top_key, keys[i].c_str());
        }
        return s;
    };
    // Depths as nlohmann counts them: an object starts and ends at its parent's depth; its keys are one deeper.
    json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
        if (depth > kJsonMaxDepth) bad(format("JSON nested deeper than %d levels", kJsonMaxDepth));
        if (event == json::parse_event_t::object_start) {
            seen.emplace_back();
        } else if (event == json::parse_event_t::object_end) {
            seen.pop_back();
            keys.resize(size_t(depth));
        } else if (event == json::parse_event_t::key) {
            keys.resize(size_t(depth - 1));
            keys.push_back(parsed.get<std::string>());
            if (!seen.back().insert(keys.back()).second) bad(location() + " appears twice");
        }
        return true;
    };
    std::string what;
    try {
        return json::parse(text, on_event);
    } catch (const json::parse_error& e) {
        what = format("not valid JSON at offset %lld: %s", (long long)(text_offset + int64_t(e.byte) - 1),
                      json_error_text(e).c_str());
    } catch (const json::exception& e) {  // a number out of range, where the keys that lead to it are known
        what = keys.empty() ? json_error_text(e) : location() + ": " + json_error_text(e);
    }
    fail(kExitData, "%s: %s", where.c_str(), what.c_str());
}

struct SafetensorsTensor {
    std::string name;
    std::string dtype;  // as in the header: "F32", "BF16", ...
    std::vector<int64_t> shape;
    int64_t numel = 0;
    int64_t begin = 0, end = 0;  // byte offsets into the data section

    std::string shape_string() const {
        std::string s = "[";
        for (size_t i = 0; i < shape.size(); i++) s += (i ? ", " : "") + std::to_string(shape[i]);
        return s + "]";
    }
};

class SafetensorsFile {
public:
    explicit SafetensorsFile(const std::string& path) : file_(path, File::Mode::Read) { parse_header(); }

    const std::string& path() const { return file_.path(); }
    // Sorted by name.
    const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
    const std::map<std::string, std::string>& metadata() const { return metadata_; }
    // Where the data section starts in the file: 8 + the header length.
    int64_t data_offset() const { return data_offset_; }

    const SafetensorsTensor* find(const std::string& name) const {
        auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                                   [](const SafetensorsTensor& t, const std::string& n) { return t.name < n; });
        return it != tensors_.end() && it->name == name ? &*it : nullptr;
    }

    const SafetensorsTensor& require(const std::string& name) const {
        const SafetensorsTensor* t = find(name);
        if (t == nullptr) fail(kExitData, "safetensors file '%s' has no tensor '%s'", path().c_str(), name.c_str());
        return *t;
    }

    // Reads tensor t (of this file) as t.numel fp32 values into out, converting F16 and BF16 exactly.
    void read_floats(const SafetensorsTensor& t, float* out) const {
        if (!safetensors_float_dtype(t.dtype)) {
            fail(kExitData, "safetensors file '%s': tensor '%s' has dtype %s; only F32, F16 and BF16 can be read",
                 path().c_str(), t.name.c_str(), t.dtype.c_str());
        }
        const int64_t offset = data_offset_ + t.begin;
        if (t.dtype == "F32") {
            file_.read_exact_at(out, size_t(t.numel) * sizeof(float), offset);
            return;
        }
        read_converted(t.numel, out, t.dtype == "BF16" ? bf16_to_float : fp16_to_float,
                       [&](uint16_t* buf, int64_t m, int64_t done) {
                           file_.read_exact_at(buf, size_t(m) * sizeof(uint16_t), offset + done * 2);
                       });
    }

private:
    using json = nlohmann::json;

    [[noreturn]] void bad(const std::string& what) const {
        fail(kExitData, "safetensors file '%s': %s", path().c_str(), what.c_str());
    }

    void parse_header() {
        const int64_t file_size = file_.size();
        if (file_size < 8) {
            bad(format("%lld bytes, shorter than the 8-byte header length (truncated, or not a safetensors file)",
                       (long long)file_size));
        }
        uint64_t n = 0;
        file_.read_exact_at(&n, sizeof(n), 0);
        if (n < 2 || n > uint64_t(kSafetensorsMaxHeader)) {
            bad(format("header length %llu at offset 0 is not in [2, %lld] (not a safetensors file?)",
                       (unsigned long long)n, (long long)kSafetensorsMaxHeader));
        }
        if (int64_t(n) > file_size - 8) {
            bad(format("header length %llu at offset 0 runs past the end of the %lld-byte file (truncated?)",
                       (unsigned long long)n, (long long)file_size));
        }
        data_offset_ = 8 + int64_t(n);
        const int64_t data_size = file_size - data_offset_;
        std::string text(size_t(n), '\0');
        file_.read_exact_at(text.data(), text.size(), 8);
        if (text[0] != '{') bad("the header (offset 8) does not start with '{'");
        const json header = parse_json_strictly(text, format("safetensors file '%s': the JSON header", path().c_str()),
                                                8, "tensor");
        if (!header.is_object()) bad("the JSON header is not an object");

        for (auto& [name, entry] : header.items()) {
            if (name != kSafetensorsMetadataKey) {
                tensors_.push_back(parse_entry(name, entry, data_size));
                continue;
            }
            if (!entry.is_object()) bad("__metadata__ is not an object of strings");
            for (auto& [key, value] : entry.items()) {
                if (!value.is_string()) bad(format("__metadata__ entry '%s' is not a string", key.c_str()));
                metadata_[key] = value.get<std::string>();
            }
        }
        std::sort(tensors_.begin(), tensors_.end(),
                  [](const SafetensorsTensor& a, const SafetensorsTensor& b) { return a.name < b.name; });
        check_no_overlap();
    }

    // A non-negative integer of the header, or an error naming the tensor and the field.
    int64_t header_int(const json& v, const std::string& name, const char* field) const {
        if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(INT64_MAX)
                                                               : v.get<int64_t>() < 0)) {
            bad(format("tensor '%s': %s holds %s, not a non-negative integer", name.c_str(), field,
                       json_excerpt(v).c_str()));
        }
        return v.get<int64_t>();
    }

    SafetensorsTensor parse_entry(const std::string& name, const json& entry, int64_t data_size) const {
        // Errors about this tensor: "tensor 'NAME': ..."
        auto bad_tensor = [&](const std::string& what) { bad(format("tensor '%s': %s", name.c_str(), what.c_str())); };
        if (!entry.is_object()) bad_tensor("the entry is not an object");
        for (const char* key : {"dtype", "shape", "data_offsets"}) {
            if (!entry.contains(key)) bad(format("tensor '%s' has no '%s'", name.c_str(), key));
        }
        SafetensorsTensor t;
        t.name = name;
        const json& dtype = entry["dtype"];
        if (!dtype.is_string()) bad_tensor(format("dtype %s is not a string", json_excerpt(dtype).c_str()));
        t.dtype = dtype.get<std::string>();
        const int item = safetensors_item_size(t.dtype);
        if (item == 0) bad(format("tensor '%s' has unknown dtype %s", name.c_str(), json_excerpt(dtype).c_str()));

        const json& shape = entry["shape"];
        if (!shape.is_array()) bad_tensor(format("shape %s is not an array", json_excerpt(shape).c_str()));
        t.numel = 1;
        // Elements x item size must stay below 2^62, far above any file, so no product below can overflow.
        const int64_t max_numel = (int64_t(1) << 62) / item;
        for (const json& d : shape) {
            int64_t dim = header_int(d, name, "shape");
            if (dim > 0 && t.numel > max_numel / dim) {
                bad_tensor(format("shape %s is too large", json_excerpt(shape).c_str()));
            }
            t.numel *= dim;
            t.shape.push_back(dim);
        }
        const json& offsets = entry["data_offsets"];
        if (!offsets.is_array() || offsets.size() != 2) {
            bad_tensor(format("data_offsets %s is not [begin, end]", json_excerpt(offsets).c_str()));
        }
        t.begin = header_int(offsets[0], name, "data_offsets");
        t.end = header_int(offsets[1], name, "data_offsets");
        if (t.end < t.begin) {
            bad_tensor(format("data_offsets [%lld, %lld] end before they begin", (long long)t.begin, (long long)t.end));
        }
        if (t.end - t.begin != t.numel * item) {
            bad_tensor(format("shape %s of %s needs %lld bytes but data_offsets [%lld, %lld] span %lld",
                              t.shape_string().c_str(), t.dtype.c_str(), (long long)(t.numel * item),
                              (long long)t.begin, (long long)t.end, (long long)(t.end - t.begin)));
        }
        if (t.end > data_size) {
            bad_tensor(format("data_offsets [%lld, %lld] run past the end of the %lld-byte data section (file offset "
                              "%llu; truncated?)", (long long)t.begin, (long long)t.end, (long long)data_size,
                              (unsigned long long)data_offset_ + (unsigned long long)t.end));
        }
        return t;
    }

    void check_no_overlap() const {
        std::vector<const SafetensorsTensor*> by_offset;
        for (const SafetensorsTensor& t : tensors_) {
            if (t.end > t.begin) by_offset.push_back(&t);
        }
        std::sort(by_offset.begin(), by_offset.end(),
                  [](const SafetensorsTensor* a, const SafetensorsTensor* b) { return a->begin < b->begin; });
        const auto it = std::adjacent_find(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) {
            return b->begin < a->end;
        });
        if (it != by_offset.end()) {
            const SafetensorsTensor &a = **it, &b = **(it + 1);
            bad(format("tensors '%s' [%lld, %lld] and '%s' [%lld, %lld] overlap in the data section", a.name.c_str(),
                       (long long)a.begin, (long long)a.end, b.name.c_str(), (long long)b.begin, (long long)b.end));
        }
    }

    File file_;
    std::vector<SafetensorsTensor> tensors_;
    std::map<std::string, std::string> metadata_;
    int64_t data_offset_ = 0;
};

// A tensor to write: its name, "F32" or "BF16", and its shape.
struct SafetensorsSpec {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
};

// Declare every tensor up front, then write() their fp32 values in that order (whole or in pieces);
// finish() checks that everything was written. Given a path, the writer creates and closes the file;
// given an open File, it writes from its position and leaves syncing and closing to the caller.
class SafetensorsWriter {
public:
    SafetensorsWriter(const std::string& path, std::vector<SafetensorsSpec> specs,
                      const std::map<std::string, std::string>& metadata = {{"format", "pt"}})
        : specs_(std::move(specs)), file_(&owned_) {
        const std::string header = header_bytes(path, metadata);
        owned_.open(path, File::Mode::Write);
        owned_.write_all(header.data(), header.size());
    }

    SafetensorsWriter(File& file, std::vector<SafetensorsSpec> specs,
                      const std::map<std::string, std::string>& metadata = {{"format", "pt"}})
        : specs_(std::move(specs)), file_(&file) {
        const std::string header = header_bytes(file.path(), metadata);
        file.write_all(header.data(), header.size());
    }

    SafetensorsWriter(const SafetensorsWriter&) = delete;
    SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

    // The next n values of the declared tensors, in order; may end inside a tensor or span several.
    void write(const float* values, int64_t n) {
        while (n > 0) {
            if (current_ >= specs_.size()) {
                fail(kExitUsage, "safetensors file '%s': more values written than the declared tensors hold",
                     file_->path().c_str());
            }
            const int64_t m = std::min(n, numel_[current_] - written_);
            write_floats(*file_, values, m, specs_[current_].dtype == "BF16");
            values += m;
            n -= m;
            written_ += m;
            skip_finished();
        }
    }

    void finish() {
        skip_finished();
        if (current_ < specs_.size()) {
            fail(kExitUsage, "safetensors file '%s': tensor '%s' was declared but only %lld of its %lld values written",
                 file_->path().c_str(), specs_[current_].name.c_str(), (long long)written_, (long long)numel_[current_]);
        }
        if (owned_.is_open()) owned_.close();
    }

private:
    // The header length and the JSON header for specs_, padded so that the data section starts 8-byte aligned;
    // fills numel_.
    std::string header_bytes(const std::string& path, const std::map<std::string, std::string>& metadata) {
        nlohmann::json header = nlohmann::json::object();
        int64_t offset = 0;
        for (const SafetensorsSpec& s : specs_) {
            if (s.dtype != "F32" && s.dtype != "BF16") {
                fail(kExitUsage, "safetensors file '%s': tensor '%s': cannot write dtype '%s' (F32 or BF16)",
                     path.c_str(), s.name.c_str(), s.dtype.c_str());
            }
            if (s.name == kSafetensorsMetadataKey || header.contains(s.name)) {
                fail(kExitUsage, "safetensors file '%s': tensor name '%s' is reserved or given twice", path.c_str(),
                     s.name.c_str());
            }
            int64_t numel = 1;
            for (int64_t d : s.shape) {
                if (d < 0) fail(kExitUsage, "safetensors file '%s': tensor '%s' has a negative dimension", path.c_str(),
                                s.name.c_str());
                numel *= d;
            }
            const int64_t bytes = numel * safetensors_item_size(s.dtype);
            header[s.name] = {{"dtype", s.dtype}, {"shape", s.shape}, {"data_offsets", {offset, offset + bytes}}};
            numel_.push_back(numel);
            offset += bytes;
        }
        if (!metadata.empty()) header[kSafetensorsMetadataKey] = metadata;
        std::string text = header.dump();
        text.append((8 - text.size() % 8) % 8, ' ');
        const uint64_t n = text.size();
        return std::string(reinterpret_cast<const char*>(&n), sizeof(n)) + text;
    }

    // Moves past every tensor that is complete (including empty ones).
    void skip_finished() {
        while (current_ < specs_.size() && written_ == numel_[current_]) {
            current_++;
            written_ = 0;
        }
    }

    std::vector<SafetensorsSpec> specs_;
    std::vector<int64_t> numel_;
    size_t current_ = 0;
    int64_t written_ = 0;
    File owned_;   // the file, when the writer was given a path
    File* file_;   // where the bytes go: &owned_, or the caller's File
};

}  // namespace llmc
