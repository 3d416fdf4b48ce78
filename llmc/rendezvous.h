/*
Who this process is in a multi-GPU run, and how the ranks agree on NCCL's unique id without MPI.
- detect_ranks(): rank, world size and local rank from flags, else the launcher's environment (mpirun,
  MVAPICH, PMI, torchrun, Slurm; MPI launchers first, as their processes inherit Slurm's variables).
- device_for_rank(), parse_rendezvous() / resolve_rendezvous(): the GPU and the --rendezvous value.
- exchange_unique_id(): a file-system rendezvous (rank 0 writes DIR/JOB.id, tagged with a per-launch
  nonce so leftovers of a killed launch are never taken; the others acknowledge) or a TCP one (rank 0
  listens on PORT). Every wait has a deadline and an error naming what was missing, never a hang.
The id is opaque (128 bytes), so this header needs neither NCCL nor CUDA and is tested on a CPU.
No authentication of TCP peers: use it on a cluster's private network.
*/
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "llmc/utils.h"

namespace llmc {

constexpr size_t kUniqueIdBytes = 128;
using UniqueId = std::array<char, kUniqueIdBytes>;

constexpr double kDefaultRendezvousTimeout = 300.0;  // seconds; a large job's ranks may start minutes apart
// The default of MultiGpuOptions::hang_timeout_s, in seconds: longer than any phase without a heartbeat
// (a checkpoint to a slow disk), short enough that a rank whose peer died frees its GPU the same hour.
constexpr double kDefaultHangTimeout = 900.0;

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

// Flags over the launcher's environment; -1 means not given. --rank and --world-size go together;
// --local-rank alone overrides only the local rank.
struct RankFlags {
    int rank = -1, world = -1, local_rank = -1;
    std::string job;
};

using EnvLookup = std::function<const char*(const char*)>;
inline const char* process_env(const char* name) { return std::getenv(name); }

inline std::string env_string(const EnvLookup& env, const char* name) {
    const char* v = env(name);
    return v != nullptr ? std::string(v) : std::string();
}

inline bool env_set(const EnvLookup& env, const char* name) { return !env_string(env, name).empty(); }

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

// The variables one kind of launcher sets for each process it starts.
struct LauncherVars {
    const char* name;        // for messages and the start-up table
    const char* world;       // its presence says this launcher started the process
    const char* rank;
    const char* local_rank;  // the GPU on the node
    const char* local_size;  // ranks on this node (== world: a one-node run)
};

// In the order they are tried (see the header comment for why Slurm comes last).
inline const LauncherVars kLaunchers[] = {
    {"mpirun", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"mvapich", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"},
    {"pmi", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"torchrun", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
};

// The job name a launcher gives all ranks of one launch ("" when it gives none).
inline std::string launcher_job(const std::string& launcher, const EnvLookup& env) {
    if (launcher == "mpirun") {
        for (const char* name : {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"}) {
            if (env_set(env, name)) return env_string(env, name);
        }
    } else if (launcher == "mvapich" || launcher == "pmi") {
        const std::string id = env_string(env, launcher == "pmi" ? "PMI_JOBID" : "MPIRUN_ID");
        if (!id.empty()) return launcher + "-" + id;
    } else if (launcher == "torchrun") {
        // The run id defaults to "none"; the master's address and port tell concurrent launches apart.
        std::string job = "torchrun";
        for (const char* name : {"TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"}) {
            if (env_set(env, name)) job += "-" + env_string(env, name);
        }
        return job;
    } else if (launcher == "slurm") {
        const std::string job = env_string(env, "SLURM_JOB_ID"), step = env_string(env, "SLURM_STEP_ID");
        if (!job.empty()) return "slurm-" + job + (step.empty() ? "" : "." + step);
    }
    return "";
}

inline RankInfo detect_ranks(const RankFlags& flags, const EnvLookup& env = process_env) {
    RankInfo r;
    const LauncherVars* from = nullptr;  // the launcher whose variables gave the ranks
    if (flags.rank >= 0 || flags.world >= 0) {
        if (flags.rank < 0 || flags.world < 1) {
            fail(kExitUsage, "--rank and --world-size go together (given: rank %d, world size %d)", flags.rank,
                 flags.world);
        }
        r = {flags.rank, flags.world, flags.rank, flags.world == 1, "flags", ""};
    } else {
        auto take = [&](const LauncherVars& l) {  // all but single_node, which each launcher tells its own way
            r.world = env_int(env, l.world, 1, true);
            r.rank = env_int(env, l.rank, 0, true);
            r.local_rank = env_int(env, l.local_rank, 0, false);
            r.launcher = l.name;
            from = &l;
        };
        for (const LauncherVars& l : kLaunchers) {
            // A PMI launcher without a local rank inside a Slurm step (srun --mpi=pmi2) is Slurm's.
            const bool slurm_pmi = std::string(l.name) == "pmi" && !env_set(env, l.local_rank) &&
                                   env_set(env, "SLURM_LOCALID") && env_set(env, "SLURM_PROCID");
            if (!env_set(env, l.world) || slurm_pmi) continue;
            take(l);
            r.single_node = env_int(env, l.local_size, 0, false) == r.world;
            break;
        }
        static const LauncherVars kSlurm = {"slurm", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", nullptr};
        if (from == nullptr && env_set(env, "SLURM_PROCID") && env_set(env, "SLURM_NTASKS")) {
            take(kSlurm);
            const char* nodes_var = env_set(env, "SLURM_STEP_NUM_NODES") ? "SLURM_STEP_NUM_NODES" : "SLURM_NNODES";
            r.single_node = env_int(env, nodes_var, 0, false) == 1;
        }
        // A rank variable without its world size: going on as rank 0 of 1 would duplicate outputs.
        for (const LauncherVars& l : kLaunchers) {
            if (from == nullptr && env_int(env, l.rank, 0, false) > 0) {
                fail(kExitUsage, "environment variable %s=%s says this is one of several ranks, but %s is not set: set "
                                 "both (or start the ranks with --rank and --world-size)",
                     l.rank, env_string(env, l.rank).c_str(), l.world);
            }
        }
        r.job = launcher_job(r.launcher, env);
    }
    if (r.world < 1) fail(kExitUsage, "%s: world size %d, need at least 1", r.launcher.c_str(), r.world);
    if (r.rank >= r.world) {
        fail(kExitUsage, "%s: rank %d is outside 0..%d for world size %d", r.launcher.c_str(), r.rank, r.world - 1,
             r.world);
    }
    if (flags.local_rank >= 0) {
        r.local_rank = flags.local_rank;
    } else if (from != nullptr && !env_set(env, from->local_rank) && r.world > 1) {
        fail(kExitUsage, "%s says this is rank %d of %d, but %s is not set, so the GPU to use is unknown: give "
                         "--local-rank",
             r.launcher.c_str(), r.rank, r.world, from->local_rank);
    }
    if (r.world == 1) r.single_node = true;
    if (!flags.job.empty()) r.job = flags.job;
    if (r.job.empty()) r.job = "llmc";
    std::replace_if(r.job.begin(), r.job.end(), [](unsigned char c) {  // a file name's part: "C" locale
        return !std::isalnum(c) && c != '-' && c != '_' && c != '.';
    }, '_');
    return r;
}

// The device index (among the `visible` ones) this rank uses.
inline int device_for_rank(const RankInfo& r, int visible) {
    if (visible < 1) fail(kExitCuda, "rank %d of %d: no GPU is visible to this process", r.rank, r.world);
    if (visible == 1) return 0;
    if (r.local_rank < visible) return r.local_rank;
    fail(kExitUsage,
         "rank %d has local rank %d, but this node has %d GPUs: start at most %d ranks per node, or give each rank "
         "one GPU (CUDA_VISIBLE_DEVICES)",
         r.rank, r.local_rank, visible, visible);
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
    if (text.empty()) return {};
    const std::string tcp = "tcp://", file = "file:";
    if (text.compare(0, tcp.size(), tcp) == 0) {
        const std::string rest = text.substr(tcp.size());
        const bool v6 = !rest.empty() && rest[0] == '[';  // then the colon must follow the first ']'
        const size_t colon = v6 ? rest.find(']') + 1 : rest.rfind(':');  // no ']': npos + 1 == 0, the '['
        if (colon >= rest.size() || rest[colon] != ':') {
            fail(kExitUsage, "--rendezvous '%s': expected tcp://%s:PORT", text.c_str(), v6 ? "[IPV6]" : "HOST");
        }
        const std::string host = v6 ? rest.substr(1, colon - 2) : rest.substr(0, colon), port = rest.substr(colon + 1);
        char* end = nullptr;
        const long p = port.empty() ? -1 : std::strtol(port.c_str(), &end, 10);
        if (host.empty() || port.empty() || *end != '\0' || p < 1 || p > 65535) {
            fail(kExitUsage, "--rendezvous '%s': expected tcp://HOST:PORT with a port in 1..65535", text.c_str());
        }
        return {RendezvousSpec::Kind::Tcp, "", host, int(p)};
    }
    const std::string dir = text.compare(0, file.size(), file) == 0 ? text.substr(file.size()) : text;
    if (dir.empty()) fail(kExitUsage, "--rendezvous '%s': expected file:DIR with a directory", text.c_str());
    return {RendezvousSpec::Kind::File, dir, "", 0};
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
    return {RendezvousSpec::Kind::File, "/tmp", "", 0};
}

// ------------------------------------------------------------------------------------------------
// Shared pieces.

inline std::string rendezvous_id_path(const std::string& dir, const std::string& job) { return dir + "/" + job + ".id"; }
inline std::string rendezvous_ack_path(const std::string& dir, const std::string& job, int rank, uint64_t nonce) {
    return dir + "/" + job + ".ack." + std::to_string(rank) + "." + format("%016" PRIx64, nonce);
}

namespace rendezvous_detail {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x4c524456;  // "LRDV"
constexpr auto kPoll = std::chrono::milliseconds(20);

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline int remaining_ms(Clock::time_point deadline) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return ms <= 0 ? 0 : int(std::min<int64_t>(ms, 1 << 30));
}

// At most 1e9 s ahead, so the nanosecond clock cannot overflow into a deadline already past.
inline Clock::time_point deadline_after(double timeout_s) {
    return Clock::now() + std::chrono::microseconds(int64_t(std::min(timeout_s, 1e9) * 1e6));
}

// Writes the words big-endian, one after another from p.
inline void put_u32s(char* p, std::initializer_list<uint32_t> words) {
    for (const uint32_t w : words) {
        const uint32_t n = htonl(w);
        std::memcpy(p, &n, 4);
        p += 4;
    }
}
inline uint32_t get_u32(const char* p) {
    uint32_t n;
    std::memcpy(&n, p, 4);
    return ntohl(n);
}

// Puts `reason` in *why and gives false: how the readers and transfers below report a failure.
inline bool failed(std::string* why, const std::string& reason) {
    *why = reason;
    return false;
}

// "ranks 1, 4, 5" (the first 16 of them, then a count).
inline std::string list_ranks(const std::vector<bool>& present) {
    std::string s;
    int missing = 0;
    for (size_t r = 1; r < present.size(); r++) {
        if (!present[r] && ++missing <= 16) s += (missing > 1 ? ", " : "") + std::to_string(r);
    }
    if (missing > 16) s += format(" and %d more", missing - 16);
    return (missing == 1 ? "rank " : "ranks ") + s;
}

// Reads up to n bytes of a whole small file; false when it does not exist (or vanished meanwhile).
inline bool read_small_file(const std::string& path, std::string* out, size_t n) {
    std::ifstream f(path, std::ios::binary);
    if (!f.is_open()) return false;
    out->assign(n, '\0');
    f.read(&(*out)[0], std::streamsize(n));
    out->resize(size_t(f.gcount()));
    return true;
}

inline std::string this_host() {
    char buf[256] = {};
    return ::gethostname(buf, sizeof(buf) - 1) == 0 ? buf : "";
}

// Whether process `pid` on this host still runs (a process of another user counts as running).
inline bool process_alive(uint32_t pid) {
    return pid != 0 && pid <= uint32_t(INT32_MAX) && (::kill(pid_t(pid), 0) == 0 || errno == EPERM);
}

// A fresh 64-bit value for each launch: entropy mixed with the time and the pid.
inline uint64_t new_nonce() {
    uint64_t x = uint64_t(Clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull ^
                 (uint64_t(::getpid()) << 32);
    try {
        std::random_device rd;
        x ^= (uint64_t(rd()) << 32) ^ uint64_t(rd());
    } catch (const std::exception&) {
    }
    return x;
}

// What rank 0 writes to JOB.id.
struct RendezvousIdFile {
    static constexpr uint32_t kVersion = 2;
    static constexpr size_t kHostBytes = 64;
    static constexpr size_t kBytes = 24 + kHostBytes + kUniqueIdBytes;  // magic, version, world, pid, nonce, host, id

    int world = 0;
    uint32_t pid = 0;
    uint64_t nonce = 0;
    std::string host;
    UniqueId id{};

    std::string encode() const {
        std::string b(kBytes, '\0');
        put_u32s(&b[0], {kMagic, kVersion, uint32_t(world), pid, uint32_t(nonce >> 32), uint32_t(nonce)});
        std::memcpy(&b[24], host.data(), std::min(host.size(), kHostBytes - 1));
        std::memcpy(&b[24 + kHostBytes], id.data(), kUniqueIdBytes);
        return b;
    }

    // Parses b; on failure returns false with the reason (naming the offset) in *why.
    bool decode(const std::string& b, std::string* why) {
        if (b.size() != kBytes) return failed(why, format("%zu bytes, expected %zu", b.size(), kBytes));
        if (get_u32(&b[0]) != kMagic || get_u32(&b[4]) != kVersion) {
            return failed(why, format("magic 0x%08x version %u at offset 0, expected 0x%08x version %u",
                                      get_u32(&b[0]), get_u32(&b[4]), kMagic, kVersion));
        }
        world = int(get_u32(&b[8]));
        pid = get_u32(&b[12]);
        nonce = (uint64_t(get_u32(&b[16])) << 32) | get_u32(&b[20]);
        host.assign(b.data() + 24, strnlen(b.data() + 24, kHostBytes));
        std::memcpy(id.data(), b.data() + 24 + kHostBytes, kUniqueIdBytes);
        return true;
    }

    // "process 123 on host node7" (+ ", which is no longer running" when that can be known here).
    std::string writer() const {
        std::string s = format("process %u on host %s", pid, host.c_str());
        if (host == this_host() && !process_alive(pid)) s += ", which is no longer running";
        return s;
    }
};

enum class IdState { Absent, Unreadable, Valid };

inline IdState read_id_file(const std::string& path, RendezvousIdFile* f, std::string* why) {
    std::string b;
    if (!read_small_file(path, &b, RendezvousIdFile::kBytes + 1)) return IdState::Absent;
    return f->decode(b, why) ? IdState::Valid : IdState::Unreadable;
}

// An acknowledgement file, and a TCP peer's hello: magic, rank, world.
constexpr size_t kAckBytes = 12;
inline std::array<char, kAckBytes> rank_and_world(int rank, int world) {
    std::array<char, kAckBytes> b;
    put_u32s(b.data(), {kMagic, uint32_t(rank), uint32_t(world)});
    return b;
}

// Removes what earlier launches of `job` left in dir: acknowledgements of other nonces, dead temporaries.
inline void remove_leftovers(const std::string& dir, const std::string& job, uint64_t nonce) {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return;
    const std::string ack = job + ".ack.", tmp = job + ".id.tmp.";
    const std::string mine = format(".%016" PRIx64, nonce);
    std::vector<std::string> stale;
    while (const dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name.compare(0, ack.size(), ack) == 0) {
            const std::string rest = name.substr(ack.size());  // RANK or RANK.NONCE
            const size_t digits = rest.find_first_not_of("0123456789");
            if (digits == 0) continue;
            const std::string tail = digits == std::string::npos ? "" : rest.substr(digits);
            const bool nonce_tail = tail.size() == 17 && tail[0] == '.' &&
                                    tail.find_first_not_of("0123456789abcdef", 1) == std::string::npos;
            if ((tail.empty() || nonce_tail) && tail != mine) stale.push_back(name);
        } else if (name.compare(0, tmp.size(), tmp) == 0) {
            const std::string pid = name.substr(tmp.size());
            if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos || pid.size() > 9) continue;
            const uint32_t p = uint32_t(std::stoul(pid));
            if (p != uint32_t(::getpid()) && !process_alive(p)) stale.push_back(name);
        }
    }
    ::closedir(d);
    for (const std::string& name : stale) std::remove((dir + "/" + name).c_str());
}

// Removes the id file if it is still this launch's (a later launch may have replaced it).
inline void remove_own_id(const std::string& path, uint64_t nonce) {
    RendezvousIdFile f;
    std::string why;
    if (read_id_file(path, &f, &why) == IdState::Valid && f.nonce == nonce) std::remove(path.c_str());
}

// Owns a file descriptor (-1: none); move-constructible, not copyable.
class Socket {
public:
    explicit Socket(int fd) : fd_(fd) {}
    Socket(Socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
    ~Socket() {
        if (fd_ >= 0) ::close(fd_);
    }
    int fd() const { return fd_; }

private:
    int fd_;
};

using AddrList = std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)>;

// The addresses of host:port; on failure, empty, with the resolver's reason in *why.
inline AddrList resolve(const std::string& host, int port, std::string* why) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list);
    if (rc != 0) *why = format("cannot resolve host '%s': %s", host.c_str(), ::gai_strerror(rc));
    return AddrList(rc == 0 ? list : nullptr, ::freeaddrinfo);
}

// Sends or receives exactly n bytes before the deadline; false (reason in *why) otherwise.
inline bool transfer(int fd, char* buf, size_t n, bool sending, Clock::time_point deadline, std::string* why) {
    size_t done = 0;
    while (done < n) {
        pollfd p{fd, short(sending ? POLLOUT : POLLIN), 0};
        const int rc = ::poll(&p, 1, remaining_ms(deadline));
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) return failed(why, rc == 0 ? "timed out" : std::strerror(errno));
        const ssize_t k = sending ? ::send(fd, buf + done, n - done, MSG_NOSIGNAL) : ::recv(fd, buf + done, n - done, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (k <= 0) return failed(why, k == 0 ? "the peer closed the connection" : std::strerror(errno));
        done += size_t(k);
    }
    return true;
}

// Connects fd (a non-blocking socket; -1: socket() failed) to a within the deadline and 5 s; false (reason
// in *why) otherwise.
inline bool connect_socket(int fd, const addrinfo* a, Clock::time_point deadline, std::string* why) {
    if (fd < 0) return failed(why, std::strerror(errno));
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) return true;
    if (errno != EINPROGRESS) return failed(why, std::strerror(errno));
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, std::min(remaining_ms(deadline), 5000)) <= 0) return failed(why, "connection attempt timed out");
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    return err == 0 || failed(why, std::strerror(err));
}

// A listening socket on `port` of every interface (dual-stack where there is IPv6); host is for the error.
inline Socket listen_everywhere(const std::string& host, int port) {
    std::string why = "no address family";
    for (const int family : {AF_INET6, AF_INET}) {
        Socket s(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
        if (s.fd() >= 0) {
            const int one = 1, zero = 0;
            ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
            if (family == AF_INET6) ::setsockopt(s.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
            sockaddr_storage a{};  // all zero bytes: the wildcard address of either family
            a.ss_family = sa_family_t(family);
            const bool v6 = family == AF_INET6;
            if (v6) reinterpret_cast<sockaddr_in6*>(&a)->sin6_port = htons(uint16_t(port));
            else reinterpret_cast<sockaddr_in*>(&a)->sin_port = htons(uint16_t(port));
            const socklen_t len = v6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
            if (::bind(s.fd(), reinterpret_cast<sockaddr*>(&a), len) == 0 && ::listen(s.fd(), 4096) == 0) return s;
        }
        why = std::strerror(errno);
    }
    fail(kExitError, "rendezvous: rank 0 cannot listen on port %d (every interface, for tcp://%s:%d): %s (is the "
                     "port in use?)", port, host.c_str(), port, why.c_str());
}

constexpr size_t kReplyBytes = 12 + kUniqueIdBytes;   // magic, status, rank 0's world, id
enum ReplyStatus : uint32_t { kReplyOk = 0, kReplyWrongWorld = 1, kReplyBadRank = 2 };

}  // namespace rendezvous_detail

// ------------------------------------------------------------------------------------------------
// File-system rendezvous.

// Rank 0: publishes the id, then takes every other rank's acknowledgement and removes the id file.
inline void file_rendezvous_publish(const std::string& dir, const std::string& job, int world, const UniqueId& id,
                                    double timeout_s) {
    namespace d = rendezvous_detail;
    const auto t0 = d::Clock::now();
    const auto deadline = d::deadline_after(timeout_s);
    const std::string path = rendezvous_id_path(dir, job);
    const d::RendezvousIdFile mine{world, uint32_t(::getpid()), d::new_nonce(), d::this_host(), id};

    d::RendezvousIdFile old;
    std::string why;
    const d::IdState before = d::read_id_file(path, &old, &why);
    if (before == d::IdState::Valid && old.host == mine.host && old.pid != mine.pid && d::process_alive(old.pid)) {
        fail(kExitUsage,
             "rendezvous file '%s' belongs to a run that is still going (process %u on this host): another run "
             "uses the job name '%s' in '%s'. Give this one another name (--rendezvous-job), or remove the file if "
             "that process is not a training run",
             path.c_str(), old.pid, job.c_str(), dir.c_str());
    }
    if (before != d::IdState::Absent) {
        std::fprintf(stderr, "rendezvous: replacing '%s', left by an earlier launch (%s)\n", path.c_str(),
                     before == d::IdState::Valid ? old.writer().c_str() : ("unreadable: " + why).c_str());
    }
    const std::string bytes = mine.encode();
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    File f(tmp, File::Mode::Write);
    f.write_all(bytes.data(), bytes.size());
    f.sync();
    f.close();
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        const int e = errno;
        std::remove(tmp.c_str());
        fail(kExitIo, "rendezvous: cannot rename '%s' to '%s': %s", tmp.c_str(), path.c_str(), std::strerror(e));
    }
    // After the new id is in place, so a rank whose old acknowledgement vanishes finds the new one.
    d::remove_leftovers(dir, job, mine.nonce);

    std::vector<bool> present(size_t(world), false);
    present[0] = true;
    auto all_in = [&] { return std::find(present.begin(), present.end(), false) == present.end(); };
    for (;;) {
        for (int r = 1; r < world; r++) {
            if (present[size_t(r)]) continue;
            const std::string ack = rendezvous_ack_path(dir, job, r, mine.nonce);
            std::string b;
            if (!d::read_small_file(ack, &b, d::kAckBytes) || b.size() < d::kAckBytes) continue;
            const int their_world = int(d::get_u32(&b[8]));
            if (their_world != world) {
                // The acknowledgement stays: with the id file gone, it tells rank r that it was refused.
                d::remove_own_id(path, mine.nonce);
                fail(kExitUsage, "rendezvous '%s': rank %d was started with a world size of %d, rank 0 with %d",
                     path.c_str(), r, their_world, world);
            }
            std::remove(ack.c_str());
            present[size_t(r)] = true;
        }
        if (all_in() || d::Clock::now() >= deadline) break;
        std::this_thread::sleep_for(d::kPoll);
    }
    d::remove_own_id(path, mine.nonce);
    if (!all_in()) {
        fail(kExitError,
             "rendezvous: rank 0 waited %.1f s in '%s' (job '%s') and %s of %d never read the id: did they start, "
             "with the same --rendezvous directory (shared by every node) and the same job name?",
             d::seconds_since(t0), dir.c_str(), job.c_str(), d::list_ranks(present).c_str(), world);
    }
}

// Ranks 1..W-1: wait for rank 0's file, acknowledge it, return its id once rank 0 took the acknowledgement.
inline UniqueId file_rendezvous_fetch(const std::string& dir, const std::string& job, int rank, int world,
                                      double timeout_s) {
    namespace d = rendezvous_detail;
    const auto t0 = d::Clock::now();
    const auto deadline = d::deadline_after(timeout_s);
    const std::string path = rendezvous_id_path(dir, job);
    bool acked = false;
    std::string ack;             // the acknowledgement this rank left, while acked
    d::RendezvousIdFile read;    // the id file it acknowledged (or last read)
    std::string unreadable;      // why the last file found could not be read
    // Takes the acknowledgement back and fails: for the world size when the file was for another, else `what`.
    auto withdraw = [&](const std::string& what) {
        std::remove(ack.c_str());
        if (read.world != world) {
            fail(kExitUsage, "rendezvous file '%s' is for %d ranks, this rank (%d) was started with %d", path.c_str(),
                 read.world, rank, world);
        }
        fail(kExitError, "%s", what.c_str());
    };
    for (;;) {
        d::RendezvousIdFile now;
        std::string why;
        d::IdState state = d::read_id_file(path, &now, &why);  // before looking at the acknowledgement
        auto same = [&] { return state == d::IdState::Valid && now.nonce == read.nonce; };
        struct stat st;
        if (acked && ::stat(ack.c_str(), &st) != 0) {
            // Taken by rank 0, or removed as a leftover once a new id landed: read the id again, not to miss it.
            state = d::read_id_file(path, &now, &why);
            if ((state == d::IdState::Absent || same()) && read.world == world) return read.id;
            acked = false;  // a new launch's rank 0 removed it as a leftover
        } else if (acked && state == d::IdState::Absent) {
            withdraw(format("rendezvous: rank 0 (%s) removed '%s' without taking rank %d's acknowledgement: it gave "
                            "up (see its output)", read.writer().c_str(), path.c_str(), rank));
        } else if (acked && !same()) {
            std::remove(ack.c_str());
            acked = false;
        }
        if (!acked && state == d::IdState::Valid) {
            read = now;
            ack = rendezvous_ack_path(dir, job, rank, read.nonce);
            const std::array<char, d::kAckBytes> b = d::rank_and_world(rank, world);
            File f(ack, File::Mode::Write);  // one small write: rank 0 reads it whole, or short and retries
            f.write_all(b.data(), b.size());
            f.close();
            acked = true;
        } else if (state == d::IdState::Unreadable) {
            unreadable = why;
        }
        if (d::Clock::now() >= deadline) {
            if (acked) {
                withdraw(format("rendezvous: rank %d waited %.1f s and the id in '%s' (from %s) was never confirmed: "
                                "a file left by an earlier launch whose rank 0 is gone? Start rank 0 with the same "
                                "--rendezvous and job name", rank, d::seconds_since(t0), path.c_str(),
                                read.writer().c_str()));
            }
            const std::string found =
                unreadable.empty() ? "it did not appear" : "found only an unreadable file (" + unreadable + ")";
            fail(kExitError,
                 "rendezvous: rank %d waited %.1f s for '%s' (written by rank 0) and %s: is rank 0 running, and is "
                 "'%s' the same shared directory on every node?",
                 rank, d::seconds_since(t0), path.c_str(), found.c_str(), dir.c_str());
        }
        std::this_thread::sleep_for(d::kPoll);
    }
}

// ------------------------------------------------------------------------------------------------
// TCP rendezvous.

// Rank 0's listening socket on `wanted` (0: the system picks; `port` tells). host is for messages.
struct TcpListener {
    TcpListener(const std::string& host_name, int wanted)
        : sock(rendezvous_detail::listen_everywhere(host_name, wanted)), host(host_name) {
        sockaddr_storage bound{};
        socklen_t len = sizeof(bound);
        ::getsockname(sock.fd(), reinterpret_cast<sockaddr*>(&bound), &len);
        port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                           : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    }
    rendezvous_detail::Socket sock;
    std::string host;
    int port = 0;
};

// Rank 0: gives the id to each of ranks 1..W-1; fails naming the ranks missing at the deadline.
inline void tcp_rendezvous_serve(TcpListener& listener, int world, const UniqueId& id, double timeout_s) {
    namespace d = rendezvous_detail;
    const auto t0 = d::Clock::now();
    const auto deadline = d::deadline_after(timeout_s);
    std::vector<bool> present(size_t(world), false);
    present[0] = true;
    while (std::find(present.begin(), present.end(), false) != present.end()) {
        pollfd p{listener.sock.fd(), POLLIN, 0};
        const int rc = ::poll(&p, 1, d::remaining_ms(deadline));
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) {
            fail(kExitError,
                 "rendezvous: rank 0 waited %.1f s on tcp://%s:%d and %s of %d did not connect: did they start, with "
                 "the same --rendezvous address?",
                 d::seconds_since(t0), listener.host.c_str(), listener.port, d::list_ranks(present).c_str(), world);
        }
        d::Socket peer(::accept4(listener.sock.fd(), nullptr, nullptr, SOCK_CLOEXEC));
        if (peer.fd() < 0) continue;  // the peer gave up between poll and accept; it will retry
        const int one = 1;
        ::setsockopt(peer.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        char hello[d::kAckBytes];
        std::string why;
        // A peer gets a few seconds to say who it is, so one stuck connection cannot eat the whole deadline.
        const auto hello_deadline = std::min(deadline, d::Clock::now() + std::chrono::seconds(10));
        if (!d::transfer(peer.fd(), hello, sizeof(hello), false, hello_deadline, &why)) continue;
        if (d::get_u32(hello) != d::kMagic) continue;  // not one of ours (a port scanner, a health check)
        const int rank = int(d::get_u32(hello + 4)), peer_world = int(d::get_u32(hello + 8));
        const uint32_t status = peer_world != world ? d::kReplyWrongWorld
                                : rank < 1 || rank >= world || present[size_t(rank)] ? d::kReplyBadRank : d::kReplyOk;
        char reply[d::kReplyBytes] = {};
        d::put_u32s(reply, {d::kMagic, status, uint32_t(world)});
        if (status == d::kReplyOk) std::memcpy(reply + 12, id.data(), kUniqueIdBytes);
        const bool sent = d::transfer(peer.fd(), reply, sizeof(reply), true, hello_deadline, &why);
        if (status == d::kReplyWrongWorld) {
            fail(kExitUsage, "rendezvous: rank %d connected to tcp://%s:%d with world size %d, rank 0 has %d", rank,
                 listener.host.c_str(), listener.port, peer_world, world);
        }
        if (status == d::kReplyBadRank) {
            fail(kExitUsage, "rendezvous: a peer connected to tcp://%s:%d as rank %d, %s", listener.host.c_str(),
                 listener.port, rank,
                 rank >= 1 && rank < world ? "which another peer already claimed" : "outside 1..world-1");
        }
        if (!sent) continue;  // the peer went away before its reply; it retries and is welcome again
        present[size_t(rank)] = true;
    }
}

// Ranks 1..W-1: connect to rank 0 (retrying name lookup and connect) and receive the id.
inline UniqueId tcp_rendezvous_fetch(const std::string& host, int port, int rank, int world, double timeout_s) {
    namespace d = rendezvous_detail;
    const auto t0 = d::Clock::now();
    const auto deadline = d::deadline_after(timeout_s);
    std::string last = "no attempt";
    for (;;) {
        const d::AddrList addrs = d::resolve(host, port, &last);
        for (const addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
            const d::Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
            std::array<char, d::kAckBytes> hello = d::rank_and_world(rank, world);
            char reply[d::kReplyBytes];
            if (!d::connect_socket(s.fd(), a, deadline, &last) ||
                !d::transfer(s.fd(), hello.data(), hello.size(), true, deadline, &last) ||
                !d::transfer(s.fd(), reply, sizeof(reply), false, deadline, &last)) {
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

// Every rank gets rank 0's id; `make_id` runs on rank 0 only. One rank needs no meeting.
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
