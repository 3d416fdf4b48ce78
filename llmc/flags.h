/*
Command-line flags from one table, which parses argv, prints --help and prints the settings table at
start-up, so the three cannot drift apart. A flag has an optional short name (-b), a long name
(--batch-size, also --batch-size=16), a typed target whose value is the default, a help line and
optionally an inclusive range. Integers are whole numbers only (1e6, 2.5k, 3M; never truncated or
wrapped); booleans 0/1/true/false; add_switch takes no value; a vector target collects a repeatable
flag; positional() takes file names; group("heading:") lists later flags apart. Errors are usage errors
(exit code 2) naming the flag.
*/
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "llmc/utils.h"

namespace llmc {

class Flags {
public:
    using Target = std::variant<int*, int64_t*, float*, double*, std::string*, bool*, std::vector<std::string>*>;

    template <class T>
    using Bound = typename std::enable_if<std::is_arithmetic<T>::value && !std::is_same<T, bool>::value, T>::type;

    explicit Flags(std::string program, std::string summary) : program_(std::move(program)), summary_(std::move(summary)) {}

    // short_name without the dash ("b"), or "" for long-only flags; long_name without dashes ("batch-size").
    template <class T>
    Flags& add(const char* short_name, const char* long_name, T* target, const char* help) {
        specs_.push_back({short_name, long_name, Target(target), help, value_string(Target(target)), false, false, {},
                          group_});
        return *this;
    }

    // A numeric flag whose value must lie in [lo, hi] (checked before an int is narrowed). The bounds are
    // not deduced, so add("", "steps", &int64_value, "...", 0, 1000) compiles.
    template <class T>
    Flags& add(const char* short_name, const char* long_name, T* target, const char* help, Bound<T> lo, Bound<T> hi) {
        add(short_name, long_name, target, help);
        Range& r = specs_.back().range;
        r = Range{true, double(lo), double(hi), 0, 0, hi == std::numeric_limits<T>::max()};
        if constexpr (std::is_integral<T>::value) {
            r.ilo = (long long)lo;
            r.ihi = (long long)hi;
        }
        return *this;
    }

    // A flag without a value ("--quiet") that sets *target to true.
    Flags& add_switch(const char* short_name, const char* long_name, bool* target, const char* help) {
        add(short_name, long_name, target, help);
        specs_.back().is_switch = true;
        return *this;
    }

    // Flags added from now on are listed after the others (and -h), under `heading` ("for tests:").
    Flags& group(const char* heading) {
        group_ = heading;
        return *this;
    }

    // Arguments that are not flags (and "-") are appended to *target; `name` shows in the usage ("INPUT...").
    Flags& positional(const char* name, std::vector<std::string>* target, const char* help) {
        positional_name_ = name;
        positional_help_ = help;
        positional_ = target;
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
            std::string flag = arg;  // as the user spelled it, without an inline value
            std::string value;
            const size_t eq = arg.find('=');
            const bool has_inline_value = arg.rfind("--", 0) == 0 && eq != std::string::npos;
            Spec* spec = nullptr;
            if (has_inline_value) {
                value = arg.substr(eq + 1);
                flag = arg.substr(0, eq);
            }
            if (arg.rfind("--", 0) == 0) {
                spec = find(flag.substr(2), false);
            } else if (arg.size() > 1 && arg[0] == '-') {
                spec = find(arg.substr(1), true);
            } else if (positional_) {
                positional_->push_back(arg);
                continue;
            } else {
                fail(kExitUsage, "unexpected argument '%s': %s takes flags only (see %s --help)", arg.c_str(),
                     program_.c_str(), program_.c_str());
            }
            if (!spec) fail(kExitUsage, "unknown flag '%s' (see %s --help)", flag.c_str(), program_.c_str());
            if (spec->is_switch) {
                if (has_inline_value) fail(kExitUsage, "flag %s takes no value", flag.c_str());
                *std::get<bool*>(spec->target) = true;
                spec->set = true;
                continue;
            }
            if (!has_inline_value) {
                if (i + 1 >= argc) fail(kExitUsage, "flag %s needs a value (%s)", flag.c_str(), spec->help);
                value = argv[++i];
            }
            set(*spec, flag, value);
        }
        return true;
    }

    std::string usage() const {
        std::string out = format("usage: %s [flags]%s%s%s\n%s\n\nflags:\n", program_.c_str(), positional_ ? " " : "",
                                 positional_ ? positional_name_ : "", positional_ ? "..." : "", summary_.c_str());
        auto line = [](const Spec& s) {
            std::string names = s.short_name[0] ? format("-%s, --%s", s.short_name, s.long_name) : format("    --%s", s.long_name);
            if (s.is_switch) return format("  %-30s %s\n", names.c_str(), s.help);
            const std::string range = s.range.on ? ", " + range_text(s) : "";
            return format("  %-30s %s (default: %s%s)\n", (names + " " + type_name(s.target)).c_str(), s.help,
                          s.default_value.empty() ? "\"\"" : s.default_value.c_str(), range.c_str());
        };
        for (const Spec& s : specs_) {
            if (!s.group[0]) out += line(s);
        }
        if (positional_) out += format("  %-30s %s\n", (std::string(positional_name_) + "...").c_str(), positional_help_);
        out += format("  %-30s %s\n", "-h, --help", "print this text and exit");
        std::string heading;
        for (const Spec& s : specs_) {
            if (!s.group[0]) continue;
            if (heading != s.group) out += format("\n%s\n", (heading = s.group).c_str());
            out += line(s);
        }
        return out;
    }

    // The settings table printed at start-up: every flag with its value, marking those the user set.
    std::string settings_table() const {
        const std::string rule = "+" + std::string(34, '-') + "+" + std::string(42, '-') + "+\n";
        std::string out = rule + format("| %-32s | %-40s |\n", "setting", "value") + rule;
        for (const Spec& s : specs_) {
            out += format("| %-32s | %-40s |\n", s.long_name, (value_string(s.target) + (s.set ? " *" : "")).c_str());
        }
        return out + rule + "(* = given on the command line)\n";
    }

    bool was_set(const char* long_name) const {
        for (const Spec& s : specs_) {
            if (std::string(s.long_name) == long_name) return s.set;
        }
        return false;
    }

private:
    struct Range {
        bool on = false;
        double lo = 0, hi = 0;        // float and double flags
        long long ilo = 0, ihi = 0;   // integer flags, exact beyond 2^53
        bool open_above = false;      // hi is the type's largest value: only the lower bound is shown
    };
    struct Spec {
        const char* short_name;
        const char* long_name;
        Target target;
        const char* help;
        std::string default_value;
        bool set;
        bool is_switch;
        Range range;
        const char* group;  // "" for the main list
    };

    // The flag named `name`: its short name when is_short ("b"), else its long name ("batch-size").
    Spec* find(const std::string& name, bool is_short) {
        for (Spec& s : specs_) {
            if (is_short ? s.short_name[0] && name == s.short_name : name == s.long_name) return &s;
        }
        return nullptr;
    }

    static std::string range_text(const Spec& s) {
        const bool integral = s.target.index() <= 1;
        if (s.range.open_above) return integral ? format("at least %lld", s.range.ilo) : format("at least %g", s.range.lo);
        return integral ? format("from %lld to %lld", s.range.ilo, s.range.ihi) : format("from %g to %g", s.range.lo, s.range.hi);
    }

    static const char* type_name(const Target& t) {
        switch (t.index()) {
            case 0: case 1: return "<int>";
            case 2: case 3: return "<float>";
            case 4: return "<string>";
            case 5: return "<0|1>";
            default: return "<string>...";
        }
    }

    static std::string value_string(const Target& t) {
        return std::visit([](auto* p) -> std::string {
            using T = std::remove_pointer_t<decltype(p)>;
            if constexpr (std::is_same_v<T, std::string>) return *p;
            else if constexpr (std::is_same_v<T, bool>) return *p ? "1" : "0";
            else if constexpr (std::is_floating_point_v<T>) return format("%g", double(*p));
            else if constexpr (std::is_integral_v<T>) return std::to_string(*p);
            else {
                std::string out;
                for (const std::string& v : *p) out += (out.empty() ? "" : ",") + v;
                return out;
            }
        }, t);
    }

    // A decimal integer, exactly: optional sign, fraction and exponent ("1e6", "2.5e3"), k/K or m/M
    // suffix ("2k", "1.5M"). False for a non-whole value, hexadecimal, blanks or a 64-bit overflow.
    static bool parse_integer(const std::string& text, long long* out) {
        size_t i = 0;
        const bool negative = i < text.size() && text[i] == '-';
        if (i < text.size() && (text[i] == '-' || text[i] == '+')) i++;
        std::string digits;  // the significand's digits, the decimal point removed
        int fraction = 0;
        for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; i++) digits += text[i];
        if (i < text.size() && text[i] == '.') {
            for (i++; i < text.size() && text[i] >= '0' && text[i] <= '9'; i++, fraction++) digits += text[i];
        }
        if (digits.empty()) return false;
        long long exponent = 0;
        if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
            i++;
            const bool minus = i < text.size() && text[i] == '-';
            if (i < text.size() && (text[i] == '-' || text[i] == '+')) i++;
            if (i == text.size() || text[i] < '0' || text[i] > '9') return false;
            for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; i++) {
                exponent = std::min(exponent * 10 + (text[i] - '0'), 1000000LL);
            }
            if (minus) exponent = -exponent;
        }
        if (i + 1 == text.size() && (text[i] == 'k' || text[i] == 'K')) exponent += 3, i++;
        else if (i + 1 == text.size() && (text[i] == 'm' || text[i] == 'M')) exponent += 6, i++;
        if (i != text.size()) return false;
        // value = digits * 10^(exponent - fraction): whole when the digits it drops are zeros.
        long long shift = exponent - fraction;
        while (shift < 0) {
            if (digits.back() != '0') return false;
            digits.pop_back();
            shift++;
            if (digits.empty()) digits = "0";
        }
        unsigned long long magnitude = 0;
        for (char c : digits) {
            if (__builtin_mul_overflow(magnitude, 10ull, &magnitude) ||
                __builtin_add_overflow(magnitude, (unsigned long long)(c - '0'), &magnitude)) {
                return false;
            }
        }
        for (; shift > 0 && magnitude != 0; shift--) {
            if (__builtin_mul_overflow(magnitude, 10ull, &magnitude)) return false;
        }
        const unsigned long long limit = negative ? 9223372036854775808ull : 9223372036854775807ull;
        if (magnitude > limit) return false;
        *out = negative ? (long long)(0 - magnitude) : (long long)magnitude;
        return true;
    }

    void set(Spec& s, const std::string& flag, const std::string& value) {
        auto bad = [&](const std::string& expected) {
            fail(kExitUsage, "flag %s: '%s' is not %s", flag.c_str(), value.c_str(), expected.c_str());
        };
        auto parse_int = [&]() -> long long {
            long long v = 0;
            if (!parse_integer(value, &v)) bad("an integer");
            if (s.range.on && (v < s.range.ilo || v > s.range.ihi)) bad("an integer " + range_text(s));
            return v;
        };
        auto parse_float = [&]() -> double {
            errno = 0;
            char* end = nullptr;
            double v = std::strtod(value.c_str(), &end);
            if (value.empty() || errno != 0 || *end != '\0') bad("a number");
            if (s.range.on && !(v >= s.range.lo && v <= s.range.hi)) bad("a number " + range_text(s));
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
            case 6: std::get<std::vector<std::string>*>(s.target)->push_back(value); break;
        }
        s.set = true;
    }

    std::string program_, summary_;
    std::vector<Spec> specs_;
    const char* group_ = "";
    std::vector<std::string>* positional_ = nullptr;
    const char* positional_name_ = "";
    const char* positional_help_ = "";
};

}  // namespace llmc
