/*
What a sample continues, for both trainers: prompt_tokens() (--prompt "text" encoded with GPT-2's
tokenizer, which needs LLMC_TOKENIZER_ENCODER, or --prompt-ids "464,3290"; not both), sample_start()
(the prompt, or one end-of-text token within the model's vocabulary) and sample_text() (the ids as text
where the tokenizer knows them all, else as numbers).
*/
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "llmc/sampler.h"
#include "llmc/tokenizer.h"
#include "llmc/utils.h"

namespace llmc {

inline std::vector<uint32_t> prompt_tokens(const std::string& text, const std::string& ids_csv,
                                           const std::string& vocab_dir, int vocab_size) {
    if (!text.empty() && !ids_csv.empty()) fail(kExitUsage, "give --prompt or --prompt-ids, not both");
    if (text.empty()) return parse_token_ids(ids_csv, vocab_size, "--prompt-ids");
#ifdef LLMC_TOKENIZER_ENCODER
    const std::string encoder_json = vocab_dir + "/encoder.json";
    const std::string vocab_bpe = vocab_dir + "/vocab.bpe";
    if (!regular_file_exists(encoder_json) || !regular_file_exists(vocab_bpe)) {
        fail(kExitUsage, "--prompt: GPT-2's vocabulary files %s and %s are missing (give --vocab-dir, or "
             "--prompt-ids)", encoder_json.c_str(), vocab_bpe.c_str());
    }
    const Gpt2Encoder encoder(load_gpt2_vocab_files(encoder_json, vocab_bpe));
    Gpt2Encoder::Context ctx(encoder);
    std::vector<uint32_t> ids = encoder.encode_ordinary(ctx, text);
    for (uint32_t id : ids) {
        if (int64_t(id) >= vocab_size) {
            fail(kExitUsage, "--prompt: token %u is outside the model's vocabulary [0, %d)", id, vocab_size);
        }
    }
    return ids;
#else
    fail(kExitUsage, "--prompt: this build has no text encoder (PCRE2's headers were missing when it was "
         "built: apt-get install libpcre2-dev, then rebuild); give --prompt-ids instead");
#endif
}

// tokenizer may be null (none loaded).
inline std::vector<uint32_t> sample_start(const std::vector<uint32_t>& prompt, const Tokenizer* tokenizer,
                                          int vocab_size) {
    if (!prompt.empty()) return prompt;
    const uint32_t eot = tokenizer != nullptr ? tokenizer->eot() : kGpt2EotToken;
    return {std::min(eot, uint32_t(vocab_size - 1))};
}

// tokenizer may be null (none loaded): the ids are then printed as numbers, "464 3290 ".
inline std::string sample_text(const Tokenizer* tokenizer, const std::vector<uint32_t>& ids) {
    const bool decodable = tokenizer != nullptr && std::all_of(ids.begin(), ids.end(), [&](uint32_t id) {
        return id < tokenizer->size();
    });
    if (decodable) return tokenizer->decode(ids);
    std::string out;
    for (uint32_t id : ids) out += format("%u ", id);
    return out;
}

}  // namespace llmc
