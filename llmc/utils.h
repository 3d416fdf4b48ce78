/*
Error reporting and checked file I/O shared by every part of the program: llmc::Error (an exception
carrying the exit code), fail(), format(), split(), run_main() ("error: ..." and that exit code),
llmc::File (every operation succeeds completely or raises an Error naming the file, offset, byte count
and the system's reason), and the filesystem steps the programs share (write_file_atomically: a crash
leaves the old file or the new one, never a mix). CUDA checks live in cuda_utils.cuh.
*/
#pragma once

#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace llmc {

// Exit codes every binary uses, documented in the README.
enum ExitCode : int {
    kExitOk = 0,
    kExitError = 1,  // anything not classified below
    kExitUsage = 2,  // bad command line
    kExitIo = 3,     // a file could not be opened, read, written, synced or closed
    kExitData = 4,   // a file was read but its contents are invalid
    kExitCuda = 5,   // a CUDA, cuBLAS or NCCL call failed
    kExitDiverged = 6,  // training stopped: too many steps in a row had a non-finite loss or gradient norm
    kExitStopped = 7,   // training stopped early on request (a signal, --time-limit) after saving a checkpoint:
                        // requeue the job and resume it with -y 1
};

class Error : public std::runtime_error {
public:
    Error(int exit_code, const std::string& message) : std::runtime_error(message), exit_code_(exit_code) {}
    int exit_code() const { return exit_code_; }

private:
    int exit_code_;
};

inline std::string vformat(const char* fmt, va_list args) {
    va_list copy;
    va_copy(copy, args);
    int n = std::vsnprintf(nullptr, 0, fmt, copy);
    va_end(copy);
    if (n < 0) return std::string(fmt);
    std::string out(static_cast<size_t>(n), '\0');
    std::vsnprintf(out.data(), out.size() + 1, fmt, args);
    return out;
}

__attribute__((format(printf, 1, 2))) inline std::string format(const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    std::string s = vformat(fmt, args);
    va_end(args);
    return s;
}

// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}.
inline std::vector<std::string> split(const std::string& text, char sep) {
    std::vector<std::string> parts(1);
    for (char c : text) {
        if (c == sep) parts.emplace_back();
        else parts.back() += c;
    }
    return parts;
}

// `text` with control characters escaped (\n, \r, \xNN; tabs kept), so a quoted file stays on one line.
inline std::string escape_controls(const std::string& text) {
    std::string out;
    out.reserve(text.size());
    for (unsigned char c : text) {
        if (c == '\n') out += "\\n";
        else if (c == '\r') out += "\\r";
        else if ((c < 0x20 && c != '\t') || c == 0x7f) out += format("\\x%02x", c);
        else out += char(c);
    }
    return out;
}

[[noreturn]] __attribute__((format(printf, 2, 3))) inline void fail(int exit_code, const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    std::string s = vformat(fmt, args);
    va_end(args);
    throw Error(exit_code, escape_controls(s));
}

// Runs fn and turns an escaping exception into a message on stderr and an exit code (never an abort).
// stdout is flushed first, so the error follows the lines that led to it.
template <class Fn>
int run_main(Fn&& fn) {
    auto report = [](const char* what, int exit_code) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: %s\n", what);
        return exit_code;
    };
    try {
        return fn();
    } catch (const Error& e) {
        return report(e.what(), e.exit_code());
    } catch (const std::bad_alloc&) {
        return report("out of host memory", kExitError);
    } catch (const std::exception& e) {
        return report(e.what(), kExitError);
    }
}

// Human-readable byte count for messages and logs ("1.50 GiB").
inline std::string human_bytes(double bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024.0 && u < 4) {
        bytes /= 1024.0;
        u++;
    }
    return u == 0 ? format("%.0f %s", bytes, units[u]) : format("%.2f %s", bytes, units[u]);
}

// Why `path` cannot be read as a regular file, in the system's words ("No such file or directory", "Is a
// directory", "is a FIFO, not a regular file", ...); "" for a regular file (or a link to one).
inline std::string why_not_regular_file(const std::string& path) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return std::strerror(errno);
    if (S_ISREG(st.st_mode)) return "";
    if (S_ISDIR(st.st_mode)) return std::strerror(EISDIR);
    const char* kind = S_ISFIFO(st.st_mode)   ? "a FIFO"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                                              : "something else";
    return format("is %s, not a regular file", kind);
}

// A file opened through POSIX calls; it tracks its own position (pread/pwrite) so errors name the offset.
class File {
public:
    enum class Mode {
        Read,       // existing file, read only
        Write,      // create or truncate, write only
        ReadWrite,  // existing file, read and write
    };

    File() = default;
    File(const std::string& path, Mode mode, bool direct = false) { open(path, mode, direct); }
    File(const File&) = delete;
    File& operator=(const File&) = delete;
    File(File&& other) noexcept { *this = std::move(other); }
    File& operator=(File&& other) noexcept {
        if (this != &other) {
            close_quietly();
            path_ = std::move(other.path_);
            fd_ = std::exchange(other.fd_, -1);
            pos_ = other.pos_;
            direct_ = other.direct_;
        }
        return *this;
    }
    ~File() { close_quietly(); }

    void open(const std::string& path, Mode mode, bool direct = false) {
        close_quietly();
        static const int kModeFlags[] = {O_RDONLY, O_WRONLY | O_CREAT | O_TRUNC, O_RDWR};  // by Mode
        const int flags = O_CLOEXEC | kModeFlags[int(mode)] | (direct ? O_DIRECT : 0);
        // A reader takes regular files only: a FIFO would block the open, a directory fail at its first read.
        std::string why = mode == Mode::Write ? "" : why_not_regular_file(path);
        const int fd = why.empty() ? ::open(path.c_str(), flags, 0644) : -1;
        if (fd < 0) {
            if (why.empty()) why = std::strerror(errno);
            fail(kExitIo, "cannot open '%s' for %s: %s", path.c_str(), mode == Mode::Read ? "reading" : "writing",
                 why.c_str());
        }
        path_ = path;
        fd_ = fd;
        pos_ = 0;
        direct_ = direct;
    }

    bool is_open() const { return fd_ >= 0; }
    const std::string& path() const { return path_; }
    int fd() const { return fd_; }
    bool direct() const { return direct_; }
    int64_t tell() const { return pos_; }

    void seek(int64_t offset) {
        require_open("seek");
        if (offset < 0) fail(kExitIo, "cannot seek '%s' to negative offset %lld", path_.c_str(), (long long)offset);
        pos_ = offset;
    }

    int64_t size() const {
        require_open("stat");
        struct stat st;
        if (::fstat(fd_, &st) != 0) fail(kExitIo, "cannot stat '%s': %s", path_.c_str(), std::strerror(errno));
        return static_cast<int64_t>(st.st_size);
    }

    // Reads up to n bytes; returns fewer only at end of file.
    size_t read_some(void* buf, size_t n) {
        const size_t done = read_at(buf, n, pos_, false);
        pos_ += static_cast<int64_t>(done);
        return done;
    }

    // Reads exactly n bytes or raises an error that says how short the file was.
    void read_exact(void* buf, size_t n) {
        read_exact_at(buf, n, pos_);
        pos_ += static_cast<int64_t>(n);
    }

    // Reads exactly n bytes at `offset` without moving the position; safe to call from several threads.
    void read_exact_at(void* buf, size_t n, int64_t offset) const { read_at(buf, n, offset, true); }

    void write_all(const void* buf, size_t n) {
        require_open("write");
        size_t done = 0;
        while (done < n) {
            ssize_t w = ::pwrite(fd_, static_cast<const char*>(buf) + done, n - done, pos_ + (int64_t)done);
            if (w < 0) {
                if (errno == EINTR) continue;
                int e = errno;
                fail(kExitIo, "write of %zu bytes to '%s' at offset %lld failed: %s%s", n - done, path_.c_str(),
                     (long long)(pos_ + done), std::strerror(e),
                     (e == ENOSPC || e == EDQUOT || e == EFBIG) ? " (is the disk full, or a file size limit set?)" : "");
            }
            if (w == 0) {
                fail(kExitIo, "write to '%s' at offset %lld made no progress", path_.c_str(), (long long)(pos_ + done));
            }
            done += static_cast<size_t>(w);
        }
        pos_ += static_cast<int64_t>(n);
    }

    void truncate(int64_t length) {
        require_open("truncate");
        if (::ftruncate(fd_, length) != 0) {
            fail(kExitIo, "cannot truncate '%s' to %lld bytes: %s", path_.c_str(), (long long)length,
                 std::strerror(errno));
        }
    }

    void sync() {
        require_open("fsync");
        if (::fsync(fd_) != 0) fail(kExitIo, "fsync of '%s' failed: %s", path_.c_str(), std::strerror(errno));
    }

    // Starts writing [offset, offset+len) back to disk now rather than at fsync. Advisory: the result is
    // deliberately unused (a pipe, /dev/full).
    void start_writeback(int64_t offset, int64_t len) const {
        if (fd_ >= 0 && len > 0) (void)::sync_file_range(fd_, offset, len, SYNC_FILE_RANGE_WRITE);
    }

    // Closing can report a deferred write error (NFS, full disk), so it is checked too.
    void close() {
        if (fd_ < 0) return;
        if (::close(std::exchange(fd_, -1)) != 0) {
            fail(kExitIo, "close of '%s' failed: %s", path_.c_str(), std::strerror(errno));
        }
    }

private:
    // Reads n bytes at offset, fewer only at end of file; there, when `exact`, raises how short the file was.
    size_t read_at(void* buf, size_t n, int64_t offset, bool exact) const {
        require_open("read");
        size_t done = 0;
        while (done < n) {
            ssize_t r = ::pread(fd_, static_cast<char*>(buf) + done, n - done, offset + (int64_t)done);
            if (r < 0) {
                if (errno == EINTR) continue;
                fail(kExitIo, "read of %zu bytes from '%s' at offset %lld failed: %s", n - done, path_.c_str(),
                     (long long)(offset + done), std::strerror(errno));
            }
            if (r == 0 && !exact) break;
            if (r == 0) {
                fail(kExitIo, "'%s' is too short: expected %zu bytes at offset %lld, the file ends after %zu (size %lld)",
                     path_.c_str(), n, (long long)offset, done, (long long)(offset + (int64_t)done));
            }
            done += static_cast<size_t>(r);
        }
        return done;
    }

    void require_open(const char* op) const {
        if (fd_ < 0) fail(kExitIo, "cannot %s '%s': the file is not open", op, path_.empty() ? "(none)" : path_.c_str());
    }
    void close_quietly() noexcept {
        if (fd_ >= 0) ::close(std::exchange(fd_, -1));
    }

    std::string path_;
    int fd_ = -1;
    int64_t pos_ = 0;
    bool direct_ = false;
};

// fsync a directory so that a rename or a new file inside it survives a crash.
inline void sync_directory(const std::string& dir) {
    int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) fail(kExitIo, "cannot open directory '%s' to sync it: %s", dir.c_str(), std::strerror(errno));
    int rc = ::fsync(fd);
    int e = errno;
    ::close(fd);
    if (rc != 0) fail(kExitIo, "fsync of directory '%s' failed: %s", dir.c_str(), std::strerror(e));
}

// True when `path` names a regular file or a link to one; false otherwise or when it cannot be examined.
inline bool regular_file_exists(const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// True when `path` names a directory, or a symbolic link to one.
inline bool directory_exists(const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The directory that holds `path`: "." for a bare name, "/" for a name in the root.
inline std::string parent_directory(const std::string& path) {
    size_t slash = path.find_last_of('/');
    if (slash == std::string::npos) return ".";
    while (slash > 0 && path[slash - 1] == '/') slash--;
    return slash == 0 ? "/" : path.substr(0, slash);
}

// mkdir -p: creates `path` and missing parents, safe against concurrent creators. Raises kExitIo naming
// the path and the reason ("is not a directory" when something else is in the way).
inline void make_directories(const std::string& path) {
    if (path.empty()) fail(kExitIo, "cannot create a directory with an empty name");
    for (size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
        const std::string prefix = path.substr(0, end);
        if (prefix.back() != '/') {
            // An existing directory may also answer EACCES or EROFS (a parent we cannot write to).
            const int e = ::mkdir(prefix.c_str(), 0755) == 0 ? 0 : errno;
            if (e != 0 && !directory_exists(prefix)) {
                if (e == EEXIST) {
                    fail(kExitIo, "cannot create directory '%s': '%s' exists and is not a directory", path.c_str(),
                         prefix.c_str());
                }
                fail(kExitIo, "cannot create directory '%s'%s: %s", prefix.c_str(),
                     prefix == path ? "" : format(" (for '%s')", path.c_str()).c_str(), std::strerror(e));
            }
        }
        if (end == std::string::npos) break;
    }
}

// The whole file at `path`, as bytes (File raises an llmc::Error naming it when it cannot be read).
inline std::string read_text_file(const std::string& path) {
    File f(path, File::Mode::Read);
    std::string s(size_t(f.size()), '\0');
    f.read_exact(s.data(), s.size());
    return s;
}

// Writes `path` whole or not at all: write(file) fills path.tmp, which is fsynced, closed and renamed over
// `path`, and the directory fsynced. On error path.tmp is removed. One writer per path at a time.
inline void write_file_atomically(const std::string& path, const std::function<void(File&)>& write) {
    const std::string tmp = path + ".tmp";
    try {
        File f(tmp, File::Mode::Write);
        write(f);
        f.sync();
        f.close();
        if (std::rename(tmp.c_str(), path.c_str()) != 0) {
            fail(kExitIo, "cannot rename '%s' to '%s': %s", tmp.c_str(), path.c_str(), std::strerror(errno));
        }
    } catch (...) {
        ::unlink(tmp.c_str());
        throw;
    }
    sync_directory(parent_directory(path));
}

// Creates dir and proves it writable with a small file, so a run finds out at start-up, not hours later.
inline void require_writable_directory(const std::string& dir, const char* what) {
    make_directories(dir);
    const std::string probe = dir + "/.write_probe_" + std::to_string(::getpid());
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int e = fd < 0 ? errno : 0;
    if (fd >= 0) {
        if (::write(fd, "x", 1) != 1 || ::fsync(fd) != 0) e = errno != 0 ? errno : EIO;
        ::close(fd);
        ::unlink(probe.c_str());
    }
    if (e != 0) fail(kExitIo, "%s '%s' is not writable: %s", what, dir.c_str(), std::strerror(e));
}

}  // namespace llmc
