/*
Command-line flags from one table: the same table parses argv, prints --help and prints the settings
table at start-up, so the three cannot drift apart.

Each flag has an optional short name (llm.c's letters, e.g. -b) and a long name (--batch-size), a typed
target variable, a default (the variable's value when the flag is added) and a help line. Both
"-b 16" and "--batch-size 16" / "--batch-size=16" work. Unknown flags, missing or malformed values are
usage errors (exit code 2) that name the flag. Booleans take 0/1/true/false.

Does not provide: cross-flag validation (the program does that after parsing, with its own messages).
*/
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <variant>
#include <vector>

#include "llmc/utils.h"

namespace llmc {

class Flags {
public:
    using Target = std::variant<int*, int64_t*, float*, double*, std::string*, bool*>;

    explicit Flags(std::string program, std::string summary) : program_(std::move(program)), summary_(std::move(summary)) {}

    // short_name without the dash ("b"), or "" for long-only flags; long_name without dashes ("batch-size").
    template <class T>
    Flags& add(const char* short_name, const char* long_name, T* target, const char* help) {
        specs_.push_back({short_name, long_name, Target(target), help, value_string(Target(target)), false});
        return *this;
    }

    // Parses argv. Returns false when --help was given (the usage has then been printed).
    bool parse(int argc, char** argv) {
        for (int i = 1; i < argc; i++) {
            std::string arg = argv[i];
            if (arg == "-h" || arg == "--help") {
                std::fputs(usage().c_str(), stdout);
                return false;
            }
            std::string value;
            bool has_inline_value = false;
            Spec* spec = nullptr;
            if (arg.rfind("--", 0) == 0) {
                std::string name = arg.substr(2);
                size_t eq = name.find('=');
                if (eq != std::string::npos) {
                    value = name.substr(eq + 1);
                    name = name.substr(0, eq);
                    has_inline_value = true;
                }
                spec = find_long(name);
            } else if (arg.size() > 1 && arg[0] == '-') {
                spec = find_short(arg.substr(1));
            }
            if (!spec) fail(kExitUsage, "unknown flag '%s' (see %s --help)", arg.c_str(), program_.c_str());
            if (!has_inline_value) {
                if (i + 1 >= argc) fail(kExitUsage, "flag %s needs a value (%s)", arg.c_str(), spec->help);
                value = argv[++i];
            }
            set(*spec, arg, value);
        }
        return true;
    }

    std::string usage() const {
        std::string out = format("usage: %s [flags]\n%s\n\nflags:\n", program_.c_str(), summary_.c_str());
        for (const Spec& s : specs_) {
            std::string names = s.short_name[0] ? format("-%s, --%s", s.short_name, s.long_name) : format("    --%s", s.long_name);
            out += format("  %-30s %s (default: %s)\n", (names + " " + type_name(s.target)).c_str(), s.help,
                          s.default_value.empty() ? "\"\"" : s.default_value.c_str());
        }
        return out;
    }

    // The settings table printed at start-up: every flag with its value, marking those the user set.
    std::string settings_table() const {
        std::string out = "+----------------------------------+------------------------------------------+\n";
        out += format("| %-32s | %-40s |\n", "setting", "value");
        out += "+----------------------------------+------------------------------------------+\n";
        for (const Spec& s : specs_) {
            std::string v = value_string(s.target);
            if (s.set) v += " *";
            out += format("| %-32s | %-40s |\n", s.long_name, v.c_str());
        }
        out += "+----------------------------------+------------------------------------------+\n";
        out += "(* = given on the command line)\n";
        return out;
    }

    bool was_set(const char* long_name) const {
        for (const Spec& s : specs_) {
            if (std::string(s.long_name) == long_name) return s.set;
        }
        return false;
    }

private:
    struct Spec {
        const char* short_name;
        const char* long_name;
        Target target;
        const char* help;
        std::string default_value;
        bool set;
    };

    Spec* find_long(const std::string& name) {
        for (Spec& s : specs_) {
            if (name == s.long_name) return &s;
        }
        return nullptr;
    }
    Spec* find_short(const std::string& name) {
        for (Spec& s : specs_) {
            if (s.short_name[0] && name == s.short_name) return &s;
        }
        return nullptr;
    }

    static const char* type_name(const Target& t) {
        switch (t.index()) {
            case 0: case 1: return "<int>";
            case 2: case 3: return "<float>";
            case 4: return "<string>";
            default: return "<0|1>";
        }
    }

    static std::string value_string(const Target& t) {
        struct V {
            std::string operator()(int* p) const { return std::to_string(*p); }
            std::string operator()(int64_t* p) const { return std::to_string(*p); }
            std::string operator()(float* p) const { return format("%g", double(*p)); }
            std::string operator()(double* p) const { return format("%g", *p); }
            std::string operator()(std::string* p) const { return *p; }
            std::string operator()(bool* p) const { return *p ? "1" : "0"; }
        };
        return std::visit(V{}, t);
    }

    void set(Spec& s, const std::string& flag, const std::string& value) {
        auto bad = [&](const char* expected) {
            fail(kExitUsage, "flag %s: '%s' is not %s", flag.c_str(), value.c_str(), expected);
        };
        auto parse_int = [&]() -> long long {
            errno = 0;
            char* end = nullptr;
            long long v = std::strtoll(value.c_str(), &end, 10);
            // Accept 1e6-style and K/M suffixes, common for batch and step counts.
            if (end && (*end == 'k' || *end == 'K') && end[1] == '\0') return v * 1000;
            if (end && (*end == 'm' || *end == 'M') && end[1] == '\0') return v * 1000000;
            if (value.empty() || errno != 0 || *end != '\0') {
                double d = std::strtod(value.c_str(), &end);
                if (!value.empty() && *end == '\0' && d == double((long long)d)) return (long long)d;
                bad("an integer");
            }
            return v;
        };
        auto parse_float = [&]() -> double {
            errno = 0;
            char* end = nullptr;
            double v = std::strtod(value.c_str(), &end);
            if (value.empty() || errno != 0 || *end != '\0') bad("a number");
            return v;
        };
        switch (s.target.index()) {
            case 0: {
                long long v = parse_int();
                if (v < INT32_MIN || v > INT32_MAX) bad("a 32-bit integer");
                *std::get<int*>(s.target) = int(v);
                break;
            }
            case 1: *std::get<int64_t*>(s.target) = parse_int(); break;
            case 2: *std::get<float*>(s.target) = float(parse_float()); break;
            case 3: *std::get<double*>(s.target) = parse_float(); break;
            case 4: *std::get<std::string*>(s.target) = value; break;
            case 5:
                if (value == "1" || value == "true") *std::get<bool*>(s.target) = true;
                else if (value == "0" || value == "false") *std::get<bool*>(s.target) = false;
                else bad("0, 1, true or false");
                break;
        }
        s.set = true;
    }

    std::string program_, summary_;
    std::vector<Spec> specs_;
};

}  // namespace llmc
