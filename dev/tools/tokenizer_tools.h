/*
The tokenizer's pieces that only the data tool and the tests use: write_tokenizer_bin() writes llm.c's
tokenizer file (llmc/tokenizer.h reads it); safe_split_point() says where a text can be cut so that
its parts encode as the whole does (prepare_data's chunks).
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include "llmc/tokenizer.h"
#include "llmc/utils.h"

namespace llmc {

inline void write_tokenizer_bin(const Tokenizer& tok, const std::string& path) {
    const uint32_t header[kTokenizerHeaderInts] = {kTokenizerMagic, 2, static_cast<uint32_t>(tok.size()), tok.eot()};
    std::string body;
    for (size_t id = 0; id < tok.size(); id++) {
        const std::string& t = tok.token(static_cast<uint32_t>(id));
        if (t.empty() || t.size() > 255) {
            fail(kExitData, "cannot write '%s': token %zu is %zu bytes long; the format holds 1 to 255", path.c_str(), id,
                 t.size());
        }
        body += static_cast<char>(static_cast<uint8_t>(t.size()));
        body += t;
    }
    // Whole or not at all, so that a failed rewrite (a full disk) leaves the previous file as it was.
    write_file_atomically(path, [&](File& f) {
        f.write_all(header, sizeof(header));
        f.write_all(body.data(), body.size());
    });
}

// Where text can be cut near `target` so the two parts encode as the whole: before a space or newline
// between two printable ASCII characters. The first such point at or after `target`, else text.size().
inline size_t safe_split_point(std::string_view text, size_t target) {
    auto printable = [](char c) { return c > ' ' && c < 0x7F; };
    for (size_t p = std::max<size_t>(target, 1); p + 1 < text.size(); p++) {
        if ((text[p] == ' ' || text[p] == '\n') && printable(text[p - 1]) && printable(text[p + 1])) return p;
    }
    return text.size();
}

}  // namespace llmc
