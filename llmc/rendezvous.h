/*
Who this process is in a multi-GPU run, and how the ranks agree on NCCL's unique id without MPI.

Provides:
- detect_ranks(): rank, world size and local rank from explicit flags, else from the launcher's
  environment: OpenMPI's mpirun (OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE), else
  Slurm's srun (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_STEP_NUM_NODES), else one process.
  The local rank picks the GPU. It also finds a job name that every rank of one launch shares.
- parse_rendezvous() / resolve_rendezvous(): the --rendezvous value, "tcp://HOST:PORT", "file:DIR"
  or a plain DIR; with none given, a run whose ranks all sit on one node meets in /tmp, and a run
  over several nodes must name one.
- The file-system rendezvous: rank 0 writes DIR/JOB.id (a short header and the 128 id bytes) through
  a temporary name and an atomic rename; the others poll until it appears, read it and leave an
  acknowledgement DIR/JOB.ack.RANK; rank 0 waits for every acknowledgement and then removes the
  files, so a later run under the same name starts clean, and a file left by a crashed run is
  reported rather than read as a fresh id.
- The TCP rendezvous: rank 0 listens on HOST:PORT and hands the id to each rank that connects and
  says who it is; the others retry the connection until the deadline.
- exchange_unique_id(), which runs the right one. Every wait has a deadline: a peer that never comes
  ends the run with an error that names the path or address, how long it waited and which ranks were
  missing, never a hang.

The id is opaque here (UniqueId, 128 bytes, NCCL's NCCL_UNIQUE_ID_BYTES; multi_gpu.cuh checks the
size against nccl.h), so this header needs neither NCCL nor CUDA and is tested on a CPU.

Does not provide: MPI (mpirun is used only as a process launcher), NCCL calls, or authentication of
the TCP peers (use it on a cluster's private network).
*/
#pragma once

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "llmc/utils.h"

namespace llmc {

constexpr size_t kUniqueIdBytes = 128;
using UniqueId = std::array<char, kUniqueIdBytes>;

constexpr double kDefaultRendezvousTimeout = 300.0;  // seconds; a large job's ranks may start minutes apart

// ------------------------------------------------------------------------------------------------
// Ranks from flags or the launcher's environment.

struct RankInfo {
    int rank = 0;
    int world = 1;
    int local_rank = 0;        // the GPU this rank uses on its node
    bool single_node = true;   // every rank on this node (known from the launcher, else assumed for W = 1)
    std::string launcher = "single process";  // for the start-up table and messages
    std::string job;           // shared by the ranks of one launch; names the rendezvous files
};

// Flags a user may give instead of (or over) the launcher's environment; -1 means not given.
struct RankFlags {
    int rank = -1, world = -1, local_rank = -1;
    std::string job;
};

using EnvLookup = std::function<const char*(const char*)>;
inline const char* process_env(const char* name) { return std::getenv(name); }

inline int env_int(const EnvLookup& env, const char* name, int fallback, bool required) {
    const char* v = env(name);
    if (v == nullptr || *v == '\0') {
        if (required) fail(kExitUsage, "environment variable %s is not set (needed to find this process's rank)", name);
        return fallback;
    }
    errno = 0;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0' || x < 0 || x > 1000000) {
        fail(kExitUsage, "environment variable %s='%s': expected a non-negative integer", name, v);
    }
    return int(x);
}

inline std::string env_string(const EnvLookup& env, const char* name) {
    const char* v = env(name);
    return v != nullptr ? std::string(v) : std::string();
}

inline RankInfo detect_ranks(const RankFlags& flags, const EnvLookup& env = process_env) {
    RankInfo r;
    const bool any_flag = flags.rank >= 0 || flags.world >= 0 || flags.local_rank >= 0;
    if (any_flag) {
        if (flags.rank < 0 || flags.world < 1) {
            fail(kExitUsage, "--rank and --world-size go together (given: rank %d, world size %d)", flags.rank,
                 flags.world);
        }
        r.rank = flags.rank;
        r.world = flags.world;
        r.local_rank = flags.local_rank >= 0 ? flags.local_rank : flags.rank;
        r.single_node = r.world == 1;
        r.launcher = "flags";
    } else if (env("OMPI_COMM_WORLD_SIZE") != nullptr) {
        r.world = env_int(env, "OMPI_COMM_WORLD_SIZE", 1, true);
        r.rank = env_int(env, "OMPI_COMM_WORLD_RANK", 0, true);
        r.local_rank = env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, true);
        r.single_node = env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 0, false) == r.world;
        r.launcher = "mpirun";
        for (const char* name : {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"}) {
            if (r.job.empty()) r.job = env_string(env, name);
        }
    } else if (env("SLURM_PROCID") != nullptr && env("SLURM_NTASKS") != nullptr) {
        r.world = env_int(env, "SLURM_NTASKS", 1, true);
        r.rank = env_int(env, "SLURM_PROCID", 0, true);
        r.local_rank = env_int(env, "SLURM_LOCALID", 0, true);
        const char* nodes_var = env("SLURM_STEP_NUM_NODES") != nullptr ? "SLURM_STEP_NUM_NODES" : "SLURM_NNODES";
        r.single_node = env_int(env, nodes_var, 0, false) == 1;
        r.launcher = "slurm";
        const std::string job = env_string(env, "SLURM_JOB_ID"), step = env_string(env, "SLURM_STEP_ID");
        if (!job.empty()) r.job = "slurm-" + job + (step.empty() ? "" : "." + step);
    }
    if (r.world < 1) fail(kExitUsage, "%s: world size %d, need at least 1", r.launcher.c_str(), r.world);
    if (r.rank >= r.world) {
        fail(kExitUsage, "%s: rank %d is outside 0..%d for world size %d", r.launcher.c_str(), r.rank, r.world - 1,
             r.world);
    }
    if (r.world == 1) r.single_node = true;
    if (!flags.job.empty()) r.job = flags.job;
    if (r.job.empty()) r.job = "llmc";
    for (char& c : r.job) {  // the job becomes part of a file name
        const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                        c == '_' || c == '.';
        if (!ok) c = '_';
    }
    return r;
}

// ------------------------------------------------------------------------------------------------
// Where the ranks meet.

struct RendezvousSpec {
    enum class Kind { None, File, Tcp };
    Kind kind = Kind::None;
    std::string dir;   // File
    std::string host;  // Tcp
    int port = 0;      // Tcp

    std::string text() const {
        switch (kind) {
            case Kind::File: return "file:" + dir;
            case Kind::Tcp: return "tcp://" + (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
                                   std::to_string(port);
            default: return "none";
        }
    }
};

// "tcp://HOST:PORT" (an IPv6 HOST in brackets), "file:DIR" or a plain DIR; "" is Kind::None.
inline RendezvousSpec parse_rendezvous(const std::string& text) {
    RendezvousSpec s;
    if (text.empty()) return s;
    const std::string tcp = "tcp://", file = "file:";
    if (text.compare(0, tcp.size(), tcp) == 0) {
        const std::string rest = text.substr(tcp.size());
        std::string host, port;
        if (!rest.empty() && rest[0] == '[') {
            const size_t close = rest.find(']');
            if (close == std::string::npos || close + 1 >= rest.size() || rest[close + 1] != ':') {
                fail(kExitUsage, "--rendezvous '%s': expected tcp://[IPV6]:PORT", text.c_str());
            }
            host = rest.substr(1, close - 1);
            port = rest.substr(close + 2);
        } else {
            const size_t colon = rest.rfind(':');
            if (colon == std::string::npos) fail(kExitUsage, "--rendezvous '%s': expected tcp://HOST:PORT", text.c_str());
            host = rest.substr(0, colon);
            port = rest.substr(colon + 1);
        }
        char* end = nullptr;
        const long p = port.empty() ? -1 : std::strtol(port.c_str(), &end, 10);
        if (host.empty() || port.empty() || *end != '\0' || p < 1 || p > 65535) {
            fail(kExitUsage, "--rendezvous '%s': expected tcp://HOST:PORT with a port in 1..65535", text.c_str());
        }
        s.kind = RendezvousSpec::Kind::Tcp;
        s.host = host;
        s.port = int(p);
        return s;
    }
    s.kind = RendezvousSpec::Kind::File;
    s.dir = text.compare(0, file.size(), file) == 0 ? text.substr(file.size()) : text;
    if (s.dir.empty()) fail(kExitUsage, "--rendezvous '%s': expected file:DIR with a directory", text.c_str());
    return s;
}

// The --rendezvous value, or the default for these ranks: none for one rank, the node's /tmp when all
// ranks share a node, and a usage error when they span nodes and nothing was named.
inline RendezvousSpec resolve_rendezvous(const std::string& flag, const RankInfo& ranks) {
    RendezvousSpec s = parse_rendezvous(flag);
    if (s.kind != RendezvousSpec::Kind::None || ranks.world == 1) return s;
    if (!ranks.single_node) {
        fail(kExitUsage,
             "%d ranks (%s) over several nodes need a meeting point: --rendezvous tcp://HOST:PORT (rank 0's host) "
             "or --rendezvous DIR (a directory every node shares)",
             ranks.world, ranks.launcher.c_str());
    }
    s.kind = RendezvousSpec::Kind::File;
    s.dir = "/tmp";
    return s;
}

// ------------------------------------------------------------------------------------------------
// Shared pieces.

namespace rendezvous_detail {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x4c524456;  // "LRDV"
constexpr size_t kHeaderBytes = 16;      // magic, world, two reserved words
constexpr auto kPoll = std::chrono::milliseconds(20);

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline int remaining_ms(Clock::time_point deadline) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return ms <= 0 ? 0 : int(std::min<int64_t>(ms, 1 << 30));
}

inline Clock::time_point deadline_after(double timeout_s) {
    return Clock::now() + std::chrono::microseconds(int64_t(timeout_s * 1e6));
}

inline void put_u32(char* p, uint32_t v) {
    const uint32_t n = htonl(v);
    std::memcpy(p, &n, 4);
}
inline uint32_t get_u32(const char* p) {
    uint32_t n;
    std::memcpy(&n, p, 4);
    return ntohl(n);
}

// "ranks 1, 4, 5" (the first 16 of them, then a count).
inline std::string list_ranks(const std::vector<bool>& present) {
    std::string s;
    int listed = 0, missing = 0;
    for (size_t r = 1; r < present.size(); r++) {
        if (present[r]) continue;
        missing++;
        if (listed < 16) {
            s += (listed ? ", " : "") + std::to_string(r);
            listed++;
        }
    }
    if (missing > listed) s += format(" and %d more", missing - listed);
    return (missing == 1 ? "rank " : "ranks ") + s;
}

inline bool file_exists(const std::string& path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
}

}  // namespace rendezvous_detail

// ------------------------------------------------------------------------------------------------
// File-system rendezvous.

inline std::string rendezvous_id_path(const std::string& dir, const std::string& job) { return dir + "/" + job + ".id"; }
inline std::string rendezvous_ack_path(const std::string& dir, const std::string& job, int rank) {
    return dir + "/" + job + ".ack." + std::to_string(rank);
}

// Rank 0: publishes the id, then waits for every other rank to acknowledge it and removes the files.
inline void file_rendezvous_publish(const std::string& dir, const std::string& job, int world, const UniqueId& id,
                                    double timeout_s) {
    namespace d = rendezvous_detail;
    const auto t0 = d::Clock::now();
    const auto deadline = d::deadline_after(timeout_s);
    const std::string path = rendezvous_id_path(dir, job);
    if (d::file_exists(path)) {
        fail(kExitUsage,
             "rendezvous file '%s' already exists: left by an earlier run that did not finish, or another run is "
             "using the job name '%s'. Remove it (rm '%s') or choose another job name",
             path.c_str(), job.c_str(), path.c_str());
    }
    char buf[d::kHeaderBytes + kUniqueIdBytes] = {};
    d::put_u32(buf, d::kMagic);
    d::put_u32(buf + 4, uint32_t(world));
    std::memcpy(buf + d::kHeaderBytes, id.data(), kUniqueIdBytes);
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    {
        File f(tmp, File::Mode::Write);
        f.write_all(buf, sizeof(buf));
        f.sync();
        f.close();
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        const int e = errno;
        std::remove(tmp.c_str());
        fail(kExitIo, "rendezvous: cannot rename '%s' to '%s': %s", tmp.c_str(), path.c_str(), std::strerror(e));
    }
    std::vector<bool> present(size_t(world), false);
    present[0] = true;
    int arrived = 1;
    for (;;) {
        for (int r = 1; r < world; r++) {
            if (!present[size_t(r)] && d::file_exists(rendezvous_ack_path(dir, job, r))) {
                present[size_t(r)] = true;
                arrived++;
            }
        }
        if (arrived == world || d::Clock::now() >= deadline) break;
        std::this_thread::sleep_for(d::kPoll);
    }
    std::remove(path.c_str());
    for (int r = 1; r < world; r++) {
        if (present[size_t(r)]) std::remove(rendezvous_ack_path(dir, job, r).c_str());
    }
    if (arrived != world) {
        fail(kExitError,
             "rendezvous: rank 0 waited %.1f s in '%s' (job '%s') and %s of %d never read the id: did they start, "
             "with the same --rendezvous directory (shared by every node) and the same job name?",
             d::seconds_since(t0), dir.c_str(), job.c_str(), d::list_ranks(present).c_str(), world);
    }
}

// Ranks 1..W-1: wait for rank 0's file, read the id, acknowledge it.
inline UniqueId file_rendezvous_fetch(const std::string& dir, const std::string& job, int rank, int world,
                                      double timeout_s) {
    namespace d = rendezvous_detail;
    const auto t0 = d::Clock::now();
    const auto deadline = d::deadline_after(timeout_s);
    const std::string path = rendezvous_id_path(dir, job);
    while (!d::file_exists(path)) {
        if (d::Clock::now() >= deadline) {
            fail(kExitError,
                 "rendezvous: rank %d waited %.1f s for '%s' (written by rank 0) and it did not appear: is rank 0 "
                 "running, and is '%s' the same shared directory on every node?",
                 rank, d::seconds_since(t0), path.c_str(), dir.c_str());
        }
        std::this_thread::sleep_for(d::kPoll);
    }
    char buf[d::kHeaderBytes + kUniqueIdBytes];
    {
        File f(path, File::Mode::Read);
        if (f.size() != int64_t(sizeof(buf))) {
            fail(kExitData, "rendezvous file '%s' has %lld bytes, expected %zu", path.c_str(), (long long)f.size(),
                 sizeof(buf));
        }
        f.read_exact(buf, sizeof(buf));
    }
    if (d::get_u32(buf) != d::kMagic) {
        fail(kExitData, "rendezvous file '%s': bad magic 0x%08x at offset 0, expected 0x%08x", path.c_str(),
             d::get_u32(buf), d::kMagic);
    }
    if (int(d::get_u32(buf + 4)) != world) {
        fail(kExitUsage, "rendezvous file '%s' is for %d ranks, this rank (%d) was started with %d", path.c_str(),
             int(d::get_u32(buf + 4)), rank, world);
    }
    UniqueId id;
    std::memcpy(id.data(), buf + d::kHeaderBytes, kUniqueIdBytes);
    File ack(rendezvous_ack_path(dir, job, rank), File::Mode::Write);
    ack.close();
    return id;
}

// ------------------------------------------------------------------------------------------------
// TCP rendezvous.

namespace rendezvous_detail {

class Socket {
public:
    Socket() = default;
    explicit Socket(int fd) : fd_(fd) {}
    Socket(Socket&& o) noexcept : fd_(o.release()) {}
    Socket& operator=(Socket&& o) noexcept {
        if (this != &o) {
            reset();
            fd_ = o.release();
        }
        return *this;
    }
    Socket(const Socket&) = delete;
    Socket& operator=(const Socket&) = delete;
    ~Socket() { reset(); }
    int fd() const { return fd_; }
    int release() { return std::exchange(fd_, -1); }
    void reset() {
        if (fd_ >= 0) ::close(std::exchange(fd_, -1));
    }

private:
    int fd_ = -1;
};

struct AddrInfo {
    addrinfo* list = nullptr;
    AddrInfo(const std::string& host, int port, bool passive) {
        addrinfo hints{};
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = passive ? AI_PASSIVE : 0;
        const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list);
        if (rc != 0) {
            fail(kExitUsage, "rendezvous: cannot resolve host '%s': %s", host.c_str(), ::gai_strerror(rc));
        }
    }
    ~AddrInfo() {
        if (list) ::freeaddrinfo(list);
    }
    AddrInfo(const AddrInfo&) = delete;
    AddrInfo& operator=(const AddrInfo&) = delete;
};

// Sends or receives exactly n bytes before the deadline; false on timeout, a closed peer or an error
// (the reason in *why).
inline bool transfer(int fd, char* buf, size_t n, bool sending, Clock::time_point deadline, std::string* why) {
    size_t done = 0;
    while (done < n) {
        pollfd p{fd, short(sending ? POLLOUT : POLLIN), 0};
        const int rc = ::poll(&p, 1, remaining_ms(deadline));
        if (rc < 0 && errno == EINTR) continue;
        if (rc < 0) {
            *why = std::strerror(errno);
            return false;
        }
        if (rc == 0) {
            *why = "timed out";
            return false;
        }
        const ssize_t k = sending ? ::send(fd, buf + done, n - done, MSG_NOSIGNAL) : ::recv(fd, buf + done, n - done, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (k < 0) {
            *why = std::strerror(errno);
            return false;
        }
        if (k == 0) {
            *why = "the peer closed the connection";
            return false;
        }
        done += size_t(k);
    }
    return true;
}

constexpr size_t kHelloBytes = 12;                    // magic, rank, world
constexpr size_t kReplyBytes = 12 + kUniqueIdBytes;   // magic, status, rank 0's world, id
enum ReplyStatus : uint32_t { kReplyOk = 0, kReplyWrongWorld = 1, kReplyBadRank = 2 };

}  // namespace rendezvous_detail

// Rank 0's listening socket, bound to HOST:PORT (port 0: the system picks one, port() tells which).
class TcpListener {
public:
    TcpListener(const std::string& host, int port) : host_(host) {
        namespace d = rendezvous_detail;
        d::AddrInfo ai(host, port, true);
        std::string last = "no address";
        for (addrinfo* a = ai.list; a != nullptr; a = a->ai_next) {
            d::Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
            if (s.fd() < 0) {
                last = std::strerror(errno);
                continue;
            }
            const int one = 1;
            ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
            if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(s.fd(), 4096) != 0) {
                last = std::strerror(errno);
                continue;
            }
            sockaddr_storage bound{};
            socklen_t len = sizeof(bound);
            ::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&bound), &len);
            port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                                : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
            sock_ = std::move(s);
            return;
        }
        fail(kExitError, "rendezvous: rank 0 cannot listen on %s:%d: %s (is the port in use, or the host not this "
                         "machine's?)", host.c_str(), port, last.c_str());
    }
    int port() const { return port_; }
    int fd() const { return sock_.fd(); }
    const std::string& host() const { return host_; }

private:
    rendezvous_detail::Socket sock_;
    std::string host_;
    int port_ = 0;
};

// Rank 0: gives the id to each of ranks 1..W-1 as they connect; fails naming the ranks that did not
// come by the deadline.
inline void tcp_rendezvous_serve(TcpListener& listener, int world, const UniqueId& id, double timeout_s) {
    namespace d = rendezvous_detail;
    const auto t0 = d::Clock::now();
    const auto deadline = d::deadline_after(timeout_s);
    std::vector<bool> present(size_t(world), false);
    present[0] = true;
    int arrived = 1;
    while (arrived < world) {
        pollfd p{listener.fd(), POLLIN, 0};
        const int rc = ::poll(&p, 1, d::remaining_ms(deadline));
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) {
            fail(kExitError,
                 "rendezvous: rank 0 waited %.1f s on tcp://%s:%d and %s of %d did not connect: did they start, with "
                 "the same --rendezvous address?",
                 d::seconds_since(t0), listener.host().c_str(), listener.port(), d::list_ranks(present).c_str(), world);
        }
        d::Socket peer(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC));
        if (peer.fd() < 0) continue;  // the peer gave up between poll and accept; it will retry
        const int one = 1;
        ::setsockopt(peer.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        char hello[d::kHelloBytes];
        std::string why;
        // A peer gets a few seconds to say who it is, so one stuck connection cannot eat the whole deadline.
        const auto hello_deadline = std::min(deadline, d::Clock::now() + std::chrono::seconds(10));
        if (!d::transfer(peer.fd(), hello, sizeof(hello), false, hello_deadline, &why)) continue;
        if (d::get_u32(hello) != d::kMagic) continue;  // not one of ours (a port scanner, a health check)
        const int rank = int(d::get_u32(hello + 4)), peer_world = int(d::get_u32(hello + 8));
        char reply[d::kReplyBytes] = {};
        d::put_u32(reply, d::kMagic);
        d::put_u32(reply + 8, uint32_t(world));
        uint32_t status = d::kReplyOk;
        if (peer_world != world) status = d::kReplyWrongWorld;
        else if (rank < 1 || rank >= world || present[size_t(rank)]) status = d::kReplyBadRank;
        d::put_u32(reply + 4, status);
        if (status == d::kReplyOk) std::memcpy(reply + 12, id.data(), kUniqueIdBytes);
        const bool sent = d::transfer(peer.fd(), reply, sizeof(reply), true, hello_deadline, &why);
        if (status == d::kReplyWrongWorld) {
            fail(kExitUsage, "rendezvous: rank %d connected to tcp://%s:%d with world size %d, rank 0 has %d", rank,
                 listener.host().c_str(), listener.port(), peer_world, world);
        }
        if (status == d::kReplyBadRank) {
            fail(kExitUsage, "rendezvous: a peer connected to tcp://%s:%d as rank %d, %s", listener.host().c_str(),
                 listener.port(), rank,
                 rank >= 1 && rank < world ? "which another peer already claimed" : "outside 1..world-1");
        }
        if (!sent) continue;  // the peer went away before its reply; it retries and is welcome again
        present[size_t(rank)] = true;
        arrived++;
    }
}

// Ranks 1..W-1: connect to rank 0 (retrying while it is not up yet) and receive the id.
inline UniqueId tcp_rendezvous_fetch(const std::string& host, int port, int rank, int world, double timeout_s) {
    namespace d = rendezvous_detail;
    const auto t0 = d::Clock::now();
    const auto deadline = d::deadline_after(timeout_s);
    std::string last = "no attempt";
    for (;;) {
        d::AddrInfo ai(host, port, false);
        for (addrinfo* a = ai.list; a != nullptr; a = a->ai_next) {
            d::Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
            if (s.fd() < 0) {
                last = std::strerror(errno);
                continue;
            }
            if (::connect(s.fd(), a->ai_addr, a->ai_addrlen) != 0) {
                if (errno != EINPROGRESS) {
                    last = std::strerror(errno);
                    continue;
                }
                pollfd p{s.fd(), POLLOUT, 0};
                if (::poll(&p, 1, std::min(d::remaining_ms(deadline), 5000)) <= 0) {
                    last = "connection attempt timed out";
                    continue;
                }
                int err = 0;
                socklen_t len = sizeof(err);
                ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
                if (err != 0) {
                    last = std::strerror(err);
                    continue;
                }
            }
            char hello[d::kHelloBytes];
            d::put_u32(hello, d::kMagic);
            d::put_u32(hello + 4, uint32_t(rank));
            d::put_u32(hello + 8, uint32_t(world));
            char reply[d::kReplyBytes];
            std::string why;
            if (!d::transfer(s.fd(), hello, sizeof(hello), true, deadline, &why) ||
                !d::transfer(s.fd(), reply, sizeof(reply), false, deadline, &why)) {
                last = why;
                continue;
            }
            if (d::get_u32(reply) != d::kMagic) {
                fail(kExitData, "rendezvous: tcp://%s:%d answered, but not as an llmc rank 0 (bad magic)", host.c_str(),
                     port);
            }
            const uint32_t status = d::get_u32(reply + 4);
            if (status == d::kReplyWrongWorld) {
                fail(kExitUsage, "rendezvous: rank 0 at tcp://%s:%d runs %d ranks, this rank (%d) was started with %d",
                     host.c_str(), port, int(d::get_u32(reply + 8)), rank, world);
            }
            if (status != d::kReplyOk) {
                fail(kExitUsage, "rendezvous: rank 0 at tcp://%s:%d refused rank %d (already taken, or out of range)",
                     host.c_str(), port, rank);
            }
            UniqueId id;
            std::memcpy(id.data(), reply + 12, kUniqueIdBytes);
            return id;
        }
        if (d::Clock::now() >= deadline) {
            fail(kExitError,
                 "rendezvous: rank %d could not get the id from rank 0 at tcp://%s:%d within %.1f s (last error: %s): "
                 "is rank 0 running, and is the address one of its interfaces that this node can reach?",
                 rank, host.c_str(), port, d::seconds_since(t0), last.c_str());
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
}

// ------------------------------------------------------------------------------------------------

// Every rank gets rank 0's id. `make_id` runs on rank 0 only (ncclGetUniqueId in multi_gpu.cuh); one
// rank needs no meeting.
inline UniqueId exchange_unique_id(const RendezvousSpec& spec, const RankInfo& ranks,
                                   const std::function<UniqueId()>& make_id,
                                   double timeout_s = kDefaultRendezvousTimeout) {
    if (ranks.world == 1) return make_id();
    switch (spec.kind) {
        case RendezvousSpec::Kind::File:
            if (ranks.rank == 0) {
                const UniqueId id = make_id();
                file_rendezvous_publish(spec.dir, ranks.job, ranks.world, id, timeout_s);
                return id;
            }
            return file_rendezvous_fetch(spec.dir, ranks.job, ranks.rank, ranks.world, timeout_s);
        case RendezvousSpec::Kind::Tcp:
            if (ranks.rank == 0) {
                TcpListener listener(spec.host, spec.port);
                const UniqueId id = make_id();
                tcp_rendezvous_serve(listener, ranks.world, id, timeout_s);
                return id;
            }
            return tcp_rendezvous_fetch(spec.host, spec.port, ranks.rank, ranks.world, timeout_s);
        default:
            fail(kExitUsage, "%d ranks need a rendezvous (--rendezvous)", ranks.world);
    }
}

}  // namespace llmc
