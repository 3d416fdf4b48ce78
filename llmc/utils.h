/*
Error reporting and checked file I/O shared by every part of the program.

Provides: llmc::Error (an exception that carries the process exit code), fail() to raise one with a
printf-style message, run_main() to turn an escaped Error into "error: ..." on stderr and that exit code,
and llmc::File, a POSIX file descriptor wrapper whose every operation either succeeds completely or
raises an Error naming the file, the offset, the byte count and the system's error text.

Does not provide: buffering (callers read and write in large blocks) or anything CUDA; CUDA checks
live in cuda_utils.cuh.
*/
#pragma once

#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

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

[[noreturn]] __attribute__((format(printf, 2, 3))) inline void fail(int exit_code, const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    std::string s = vformat(fmt, args);
    va_end(args);
    throw Error(exit_code, s);
}

// Runs fn and converts an escaping exception into a message on stderr and an exit code, so that user
// errors never end in an abort or a core dump. stdout is flushed first: when it is a pipe it is fully
// buffered, and the error would otherwise appear before the lines that led to it.
template <class Fn>
int run_main(Fn&& fn) {
    try {
        return fn();
    } catch (const Error& e) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: %s\n", e.what());
        return e.exit_code();
    } catch (const std::bad_alloc&) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: out of host memory\n");
        return kExitError;
    } catch (const std::exception& e) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: %s\n", e.what());
        return kExitError;
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

// A file opened through POSIX calls. Reads and writes happen at the file's current position, which
// the object tracks itself (pread/pwrite), so an error can always name the offset.
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
        int flags = O_CLOEXEC;
        switch (mode) {
            case Mode::Read: flags |= O_RDONLY; break;
            case Mode::Write: flags |= O_WRONLY | O_CREAT | O_TRUNC; break;
            case Mode::ReadWrite: flags |= O_RDWR; break;
        }
        if (direct) flags |= O_DIRECT;
        int fd = ::open(path.c_str(), flags, 0644);
        if (fd < 0) {
            int e = errno;
            fail(kExitIo, "cannot open '%s' for %s: %s", path.c_str(),
                 mode == Mode::Read ? "reading" : "writing", std::strerror(e));
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
        if (::fstat(fd_, &st) != 0) {
            int e = errno;
            fail(kExitIo, "cannot stat '%s': %s", path_.c_str(), std::strerror(e));
        }
        return static_cast<int64_t>(st.st_size);
    }

    // Reads up to n bytes; returns fewer only at end of file.
    size_t read_some(void* buf, size_t n) {
        require_open("read");
        size_t done = 0;
        while (done < n) {
            ssize_t r = ::pread(fd_, static_cast<char*>(buf) + done, n - done, pos_ + (int64_t)done);
            if (r < 0) {
                if (errno == EINTR) continue;
                int e = errno;
                fail(kExitIo, "read of %zu bytes from '%s' at offset %lld failed: %s", n - done, path_.c_str(),
                     (long long)(pos_ + done), std::strerror(e));
            }
            if (r == 0) break;
            done += static_cast<size_t>(r);
        }
        pos_ += static_cast<int64_t>(done);
        return done;
    }

    // Reads exactly n bytes or raises an error that says how short the file was.
    void read_exact(void* buf, size_t n) {
        read_exact_at(buf, n, pos_);
        pos_ += static_cast<int64_t>(n);
    }

    // Reads exactly n bytes at `offset` without moving the position; safe to call from several threads.
    void read_exact_at(void* buf, size_t n, int64_t offset) const {
        require_open("read");
        size_t done = 0;
        while (done < n) {
            ssize_t r = ::pread(fd_, static_cast<char*>(buf) + done, n - done, offset + (int64_t)done);
            if (r < 0) {
                if (errno == EINTR) continue;
                int e = errno;
                fail(kExitIo, "read of %zu bytes from '%s' at offset %lld failed: %s", n - done, path_.c_str(),
                     (long long)(offset + done), std::strerror(e));
            }
            if (r == 0) {
                fail(kExitIo, "'%s' is too short: expected %zu bytes at offset %lld, the file ends after %zu (size %lld)",
                     path_.c_str(), n, (long long)offset, done, (long long)(offset + (int64_t)done));
            }
            done += static_cast<size_t>(r);
        }
    }

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
            int e = errno;
            fail(kExitIo, "cannot truncate '%s' to %lld bytes: %s", path_.c_str(), (long long)length, std::strerror(e));
        }
    }

    void sync() {
        require_open("fsync");
        if (::fsync(fd_) != 0) {
            int e = errno;
            fail(kExitIo, "fsync of '%s' failed: %s", path_.c_str(), std::strerror(e));
        }
    }

    // Starts writing [offset, offset+len) back to disk now rather than at fsync, so that a streaming writer keeps
    // the disk busy. Advisory: a file that does not support it (a pipe, /dev/full) just goes without, so the
    // result is deliberately unused.
    void start_writeback(int64_t offset, int64_t len) const {
        if (fd_ >= 0 && len > 0) (void)::sync_file_range(fd_, offset, len, SYNC_FILE_RANGE_WRITE);
    }

    // Closing can report a deferred write error (NFS, full disk), so it is checked too.
    void close() {
        if (fd_ < 0) return;
        int fd = std::exchange(fd_, -1);
        if (::close(fd) != 0) {
            int e = errno;
            fail(kExitIo, "close of '%s' failed: %s", path_.c_str(), std::strerror(e));
        }
    }

private:
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
    if (fd < 0) {
        int e = errno;
        fail(kExitIo, "cannot open directory '%s' to sync it: %s", dir.c_str(), std::strerror(e));
    }
    int rc = ::fsync(fd);
    int e = errno;
    ::close(fd);
    if (rc != 0) fail(kExitIo, "fsync of directory '%s' failed: %s", dir.c_str(), std::strerror(e));
}

}  // namespace llmc
