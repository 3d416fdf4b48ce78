/*
One assertion the tests share: a call must raise llmc::Error with a given exit code and a message that
contains every given fragment (so a test pins what the user reads, not just that something failed).
*/
#pragma once

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "llmc/utils.h"

template <class F>
void expect_error(F&& f, int exit_code, const std::vector<std::string>& parts) {
    try {
        f();
        ADD_FAILURE() << "expected an error containing '" << (parts.empty() ? "" : parts[0]) << "'";
    } catch (const llmc::Error& e) {
        EXPECT_EQ(e.exit_code(), exit_code) << e.what();
        for (const auto& p : parts) {
            EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
        }
    }
}
