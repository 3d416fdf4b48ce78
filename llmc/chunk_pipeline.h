/*
The chunk schedule behind file_to_device / device_to_file, written against a small copy interface
(StagingCopier: CUDA's in device_file_io.cuh, memcpy in the tests) so it is tested without a GPU.
A transfer is cut into chunks (ChunkPlanner) through two alternating staging buffers, so the file I/O
and the device copy overlap. An optional ChunkHook sees every chunk in its staging buffer (the
checkpoint checksums there: the bytes checked are the bytes on disk). With direct I/O the aligned middle
goes through an O_DIRECT descriptor, the unaligned head and tail through the caller's.
*/
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "llmc/utils.h"

namespace llmc {

constexpr size_t kDefaultChunkBytes = size_t(32) << 20;
constexpr size_t kDirectAlignment = 4096;

// Sees one chunk in its staging buffer: `bytes` bytes at `file_offset` in the file. Called from two
// threads at once when reading, so it must be thread safe; an exception abandons the transfer.
using ChunkHook = std::function<void(const char* host_chunk, size_t bytes, uint64_t file_offset)>;

// One piece of a transfer: bytes [offset, offset + bytes) of the payload, at file position
// transfer_start + offset; `direct` when it goes through the O_DIRECT descriptor.
struct Chunk {
    uint64_t offset = 0;
    size_t bytes = 0;
    bool direct = false;
};

// Cuts [0, nbytes) into chunks of at most chunk_bytes. With direct_alignment > 0 the largest aligned span
// is marked direct, and no chunk mixes direct and buffered bytes.
class ChunkPlanner {
public:
    ChunkPlanner(int64_t file_start, uint64_t nbytes, size_t chunk_bytes, size_t direct_alignment = 0)
        : nbytes_(nbytes), chunk_bytes_(chunk_bytes) {
        if (chunk_bytes == 0) fail(kExitUsage, "chunk size must be at least 1 byte");
        body_begin_ = body_end_ = nbytes;  // no direct span
        if (direct_alignment > 0) {
            uint64_t a = direct_alignment;
            uint64_t start = static_cast<uint64_t>(file_start);
            uint64_t aligned_begin = (start + a - 1) / a * a;  // file offsets of the aligned span
            uint64_t aligned_end = (start + nbytes) / a * a;
            if (aligned_end > aligned_begin) {
                body_begin_ = aligned_begin - start;
                body_end_ = aligned_end - start;
            }
        }
    }

    bool has_direct_span() const { return body_end_ > body_begin_; }

    bool next(Chunk& out) {
        if (pos_ >= nbytes_) return false;
        const bool direct = pos_ >= body_begin_ && pos_ < body_end_;
        const uint64_t limit = pos_ < body_begin_ ? body_begin_ : direct ? body_end_ : nbytes_;
        out = {pos_, static_cast<size_t>(std::min<uint64_t>(chunk_bytes_, limit - pos_)), direct};
        pos_ += out.bytes;
        return true;
    }

private:
    uint64_t nbytes_;
    size_t chunk_bytes_;
    uint64_t body_begin_, body_end_;
    uint64_t pos_ = 0;
};

// The copy engine a pipeline drives. Two staging slots (0 and 1) of chunk_bytes() each.
class StagingCopier {
public:
    virtual ~StagingCopier() = default;
    virtual size_t chunk_bytes() const = 0;
    virtual char* staging(int slot) = 0;
    // Starts copying n bytes from device memory into staging slot `slot`.
    virtual void to_host_async(int slot, const void* device_src, size_t n) = 0;
    // Starts copying n bytes from staging slot `slot` to device memory.
    virtual void to_device_async(void* device_dst, int slot, size_t n) = 0;
    // Returns once the last copy started on `slot` has finished (at once if none is pending).
    virtual void wait(int slot) = 0;
    // Called first on each extra reader thread, so the copier can make that thread use its device.
    virtual void bind_thread() {}
    // Waits for every pending copy without raising (a transfer abandoned by an error).
    virtual void drain() noexcept = 0;
};

namespace detail {

template <class Body>
void with_drain_on_error(StagingCopier& copier, Body&& body) {
    try {
        body();
    } catch (...) {
        copier.drain();
        throw;
    }
}

}  // namespace detail

// Writes n bytes of device memory to `file` at its current position and advances it by n.
// direct_alignment > 0 routes the aligned middle through O_DIRECT.
inline void pipelined_device_to_file(StagingCopier& copier, File& file, const void* device_src, uint64_t n,
                                     size_t direct_alignment = 0, const ChunkHook& hook = nullptr) {
    const int64_t start = file.tell();
    ChunkPlanner plan(start, n, copier.chunk_bytes(), direct_alignment);
    const char* src = static_cast<const char*>(device_src);
    Chunk cur;
    if (!plan.next(cur)) return;
    File direct_file;  // the O_DIRECT twin of `file`, for the direct span
    if (plan.has_direct_span()) direct_file = File(file.path(), File::Mode::ReadWrite, /*direct=*/true);
    detail::with_drain_on_error(copier, [&] {
        copier.to_host_async(0, src + cur.offset, cur.bytes);
        for (int slot = 0;; slot ^= 1) {
            Chunk nxt;
            bool has_next = plan.next(nxt);
            // The other slot's last chunk is already on disk, so its buffer is free for the next copy.
            if (has_next) copier.to_host_async(slot ^ 1, src + nxt.offset, nxt.bytes);
            copier.wait(slot);
            if (hook) hook(copier.staging(slot), cur.bytes, uint64_t(start) + cur.offset);
            File& out = cur.direct ? direct_file : file;
            out.seek(start + static_cast<int64_t>(cur.offset));
            out.write_all(copier.staging(slot), cur.bytes);
            // Start this chunk's writeback now, so the disk works while the next chunks are copied.
            if (!cur.direct) out.start_writeback(start + static_cast<int64_t>(cur.offset), int64_t(cur.bytes));
            if (!has_next) break;
            cur = nxt;
        }
        if (direct_file.is_open()) direct_file.close();
    });
    file.seek(start + static_cast<int64_t>(n));
}

// Reads n bytes from `file` at its current position into device memory and advances it by n; returns
// once the bytes are on the device. A short file is an error before anything is copied. With readers = 2,
// two threads read alternate chunks into their own staging buffers (docs/lab-notes.md).
inline void pipelined_file_to_device(StagingCopier& copier, void* device_dst, File& file, uint64_t n,
                                     size_t direct_alignment = 0, int readers = 2, const ChunkHook& hook = nullptr) {
    const int64_t start = file.tell();
    if (n == 0) return;
    int64_t size = file.size();
    if (start + static_cast<int64_t>(n) > size) {
        fail(kExitIo, "'%s' is too short: expected %llu bytes at offset %lld, but the file is %lld bytes",
             file.path().c_str(), (unsigned long long)n, (long long)start, (long long)size);
    }
    if (readers < 1 || readers > 2) fail(kExitUsage, "file_to_device takes 1 or 2 readers (got %d)", readers);
    ChunkPlanner plan(start, n, copier.chunk_bytes(), direct_alignment);
    if (n <= copier.chunk_bytes()) readers = 1;
    char* dst = static_cast<char*>(device_dst);
    File direct_file;
    if (plan.has_direct_span()) direct_file = File(file.path(), File::Mode::Read, /*direct=*/true);

    std::mutex plan_mutex;
    std::atomic<bool> stop{false};
    // Reader `slot` owns staging buffer `slot`; chunks go to whichever reader asks next.
    auto read_chunks = [&](int slot) {
        for (;;) {
            Chunk c;
            {
                std::lock_guard<std::mutex> lock(plan_mutex);
                if (stop.load() || !plan.next(c)) return;
            }
            copier.wait(slot);  // the copy that last used this buffer must be done before we refill it
            const File& in = c.direct ? direct_file : file;
            in.read_exact_at(copier.staging(slot), c.bytes, start + static_cast<int64_t>(c.offset));
            if (hook) hook(copier.staging(slot), c.bytes, uint64_t(start) + c.offset);
            copier.to_device_async(dst + c.offset, slot, c.bytes);
        }
    };
    // A reader's error stops both; it is raised once both are done (reader 0's first).
    std::exception_ptr errors[2];
    auto reader = [&](int slot) {
        try {
            if (slot == 1) copier.bind_thread();
            read_chunks(slot);
        } catch (...) {
            errors[slot] = std::current_exception();
            stop = true;
        }
    };
    detail::with_drain_on_error(copier, [&] {
        std::thread helper;
        if (readers == 2) helper = std::thread(reader, 1);
        reader(0);
        if (helper.joinable()) helper.join();
        for (const std::exception_ptr& e : errors) {
            if (e) std::rethrow_exception(e);
        }
        copier.wait(0);
        copier.wait(1);
    });
    file.seek(start + static_cast<int64_t>(n));
}

}  // namespace llmc
