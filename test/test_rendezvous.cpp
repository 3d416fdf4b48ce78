/*
CPU tests of llmc/rendezvous.h: rank detection from flags and from mpirun's and Slurm's environments,
the parsing of --rendezvous, and the two ways of handing NCCL's unique id around, run between real
processes (fork): the file-system rendezvous in a temporary directory and the TCP one over 127.0.0.1
on a port the system picks. Every rank must end with rank 0's id; a rank whose peers never come must
fail by its deadline with a message that names the path or address and the missing ranks.
*/
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "llmc/rendezvous.h"
#include "test/test_util.h"
#include "test/expect_error.h"

using namespace llmc;

namespace {

EnvLookup env_of(const std::map<std::string, std::string>& vars) {
    return [vars](const char* name) -> const char* {
        auto it = vars.find(name);
        return it == vars.end() ? nullptr : it->second.c_str();
    };
}

UniqueId random_id(uint64_t seed) {
    const std::vector<char> b = test::random_bytes(kUniqueIdBytes, seed);
    UniqueId id;
    std::copy(b.begin(), b.end(), id.begin());
    return id;
}

// What one forked rank ended with: the id, or the error's exit code and message.
struct Outcome {
    bool ok = false;
    UniqueId id{};
    int exit_code = 0;
    std::string message;
};

// Runs fn(rank) in `world` child processes at once and collects each one's outcome through a file.
template <class F>
std::vector<Outcome> run_ranks(int world, const std::string& dir, F&& fn) {
    std::vector<pid_t> pids;
    for (int r = 0; r < world; r++) {
        const pid_t pid = ::fork();
        if (pid < 0) throw std::runtime_error("fork failed");
        if (pid == 0) {
            std::string out;
            try {
                const UniqueId id = fn(r);
                out = "O" + std::string(id.begin(), id.end());
            } catch (const Error& e) {
                out = "E" + std::to_string(e.exit_code()) + " " + e.what();
            } catch (const std::exception& e) {
                out = std::string("E1 ") + e.what();
            }
            FILE* f = std::fopen((dir + "/outcome." + std::to_string(r)).c_str(), "wb");
            if (f) {
                std::fwrite(out.data(), 1, out.size(), f);
                std::fclose(f);
            }
            ::_exit(0);
        }
        pids.push_back(pid);
    }
    for (pid_t pid : pids) {
        int status = 0;
        ::waitpid(pid, &status, 0);
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "a rank crashed";
    }
    std::vector<Outcome> outcomes(static_cast<size_t>(world));
    for (int r = 0; r < world; r++) {
        const std::string path = dir + "/outcome." + std::to_string(r);
        FILE* f = std::fopen(path.c_str(), "rb");
        if (!f) {
            outcomes[size_t(r)].message = "no outcome file";
            continue;
        }
        std::string s;
        char buf[4096];
        size_t n;
        while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) s.append(buf, n);
        std::fclose(f);
        std::remove(path.c_str());
        Outcome& o = outcomes[size_t(r)];
        if (!s.empty() && s[0] == 'O' && s.size() == 1 + kUniqueIdBytes) {
            o.ok = true;
            std::copy(s.begin() + 1, s.end(), o.id.begin());
        } else if (!s.empty() && s[0] == 'E') {
            o.exit_code = std::atoi(s.c_str() + 1);
            o.message = s.substr(s.find(' ') + 1);
        } else {
            o.message = "malformed outcome";
        }
    }
    return outcomes;
}

std::vector<std::string> files_in(const std::string& dir) {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir)) names.push_back(e.path().filename().string());
    return names;
}

}  // namespace

// ------------------------------------------------------------------------------------------------

TEST(DetectRanks, SingleProcessByDefault) {
    const RankInfo r = detect_ranks({}, env_of({}));
    EXPECT_EQ(r.rank, 0);
    EXPECT_EQ(r.world, 1);
    EXPECT_EQ(r.local_rank, 0);
    EXPECT_TRUE(r.single_node);
    EXPECT_EQ(r.job, "llmc");
}

TEST(DetectRanks, OpenMpi) {
    const RankInfo r = detect_ranks({}, env_of({{"OMPI_COMM_WORLD_RANK", "5"},
                                                {"OMPI_COMM_WORLD_SIZE", "16"},
                                                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                                {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"},
                                                {"PMIX_NAMESPACE", "prterun-node7-123@1"},
                                                {"SLURM_PROCID", "0"},  // mpirun inside an allocation: OMPI wins
                                                {"SLURM_NTASKS", "2"}}));
    EXPECT_EQ(r.rank, 5);
    EXPECT_EQ(r.world, 16);
    EXPECT_EQ(r.local_rank, 1);
    EXPECT_FALSE(r.single_node);
    EXPECT_EQ(r.launcher, "mpirun");
    EXPECT_EQ(r.job, "prterun-node7-123_1");  // made safe for a file name
    const RankInfo one_node = detect_ranks({}, env_of({{"OMPI_COMM_WORLD_RANK", "2"},
                                                       {"OMPI_COMM_WORLD_SIZE", "4"},
                                                       {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                                                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
    EXPECT_TRUE(one_node.single_node);
    EXPECT_EQ(one_node.local_rank, 2);
}

TEST(DetectRanks, Slurm) {
    const RankInfo r = detect_ranks({}, env_of({{"SLURM_PROCID", "9"},
                                                {"SLURM_NTASKS", "12"},
                                                {"SLURM_LOCALID", "3"},
                                                {"SLURM_STEP_NUM_NODES", "2"},
                                                {"SLURM_JOB_ID", "4242"},
                                                {"SLURM_STEP_ID", "0"}}));
    EXPECT_EQ(r.rank, 9);
    EXPECT_EQ(r.world, 12);
    EXPECT_EQ(r.local_rank, 3);
    EXPECT_FALSE(r.single_node);
    EXPECT_EQ(r.launcher, "slurm");
    EXPECT_EQ(r.job, "slurm-4242.0");
    const RankInfo one = detect_ranks({}, env_of({{"SLURM_PROCID", "1"},
                                                  {"SLURM_NTASKS", "4"},
                                                  {"SLURM_LOCALID", "1"},
                                                  {"SLURM_NNODES", "1"}}));
    EXPECT_TRUE(one.single_node);
}

TEST(DetectRanks, FlagsOverrideTheEnvironment) {
    RankFlags f;
    f.rank = 3;
    f.world = 4;
    f.job = "my run";
    const RankInfo r = detect_ranks(f, env_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}}));
    EXPECT_EQ(r.rank, 3);
    EXPECT_EQ(r.world, 4);
    EXPECT_EQ(r.local_rank, 3);  // no --local-rank: the rank itself
    EXPECT_FALSE(r.single_node);
    EXPECT_EQ(r.launcher, "flags");
    EXPECT_EQ(r.job, "my_run");
    f.local_rank = 0;
    EXPECT_EQ(detect_ranks(f, env_of({})).local_rank, 0);
}

TEST(DetectRanks, BadValuesAreUsageErrors) {
    expect_error([] { detect_ranks({}, env_of({{"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "x1"}})); },
                 kExitUsage, {"OMPI_COMM_WORLD_RANK='x1'", "non-negative integer"});
    expect_error([] { detect_ranks({}, env_of({{"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "1"}})); },
                 kExitUsage, {"OMPI_COMM_WORLD_LOCAL_RANK is not set"});
    expect_error([] {
        detect_ranks({}, env_of({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}}));
    }, kExitUsage, {"slurm", "rank 4 is outside 0..3"});
    expect_error([] { detect_ranks({}, env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "-2"}})); }, kExitUsage,
                 {"SLURM_NTASKS='-2'"});
    RankFlags f;
    f.rank = 1;
    expect_error([&] { detect_ranks(f, env_of({})); }, kExitUsage, {"--rank and --world-size go together"});
}

TEST(RendezvousSpec, Parsing) {
    EXPECT_EQ(parse_rendezvous("").kind, RendezvousSpec::Kind::None);
    const RendezvousSpec t = parse_rendezvous("tcp://node-01.cluster:29500");
    EXPECT_EQ(t.kind, RendezvousSpec::Kind::Tcp);
    EXPECT_EQ(t.host, "node-01.cluster");
    EXPECT_EQ(t.port, 29500);
    EXPECT_EQ(t.text(), "tcp://node-01.cluster:29500");
    const RendezvousSpec v6 = parse_rendezvous("tcp://[::1]:1234");
    EXPECT_EQ(v6.host, "::1");
    EXPECT_EQ(v6.port, 1234);
    EXPECT_EQ(v6.text(), "tcp://[::1]:1234");
    EXPECT_EQ(parse_rendezvous("file:/shared/rdv").dir, "/shared/rdv");
    EXPECT_EQ(parse_rendezvous("/shared/rdv").kind, RendezvousSpec::Kind::File);
    EXPECT_EQ(parse_rendezvous("/shared/rdv").dir, "/shared/rdv");
    for (const char* bad : {"tcp://host", "tcp://host:", "tcp://:80", "tcp://h:0", "tcp://h:65536", "tcp://h:12x",
                            "tcp://[::1", "file:"}) {
        expect_error([&] { parse_rendezvous(bad); }, kExitUsage, {"--rendezvous"});
    }
}

TEST(RendezvousSpec, Defaults) {
    RankInfo r;
    EXPECT_EQ(resolve_rendezvous("", r).kind, RendezvousSpec::Kind::None);
    r.world = 4;
    r.single_node = true;
    EXPECT_EQ(resolve_rendezvous("", r).text(), "file:/tmp");
    EXPECT_EQ(resolve_rendezvous("tcp://10.0.0.1:5000", r).text(), "tcp://10.0.0.1:5000");
    r.single_node = false;
    expect_error([&] { resolve_rendezvous("", r); }, kExitUsage, {"over several nodes", "--rendezvous"});
    EXPECT_EQ(resolve_rendezvous("/nfs/x", r).text(), "file:/nfs/x");
}

// ------------------------------------------------------------------------------------------------

TEST(FileRendezvous, EveryRankGetsRankZerosId) {
    for (int world : {2, 3, 8}) {
        test::TempDir dir("rdv_file");
        const UniqueId id = random_id(uint64_t(world) * 7 + 1);
        RendezvousSpec spec = parse_rendezvous(dir.path());
        auto outcomes = run_ranks(world, dir.path(), [&](int rank) {
            RankInfo r;
            r.rank = rank;
            r.world = world;
            r.job = "job" + std::to_string(world);
            // Rank 0 comes last, so the others must poll for its file.
            if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
            return exchange_unique_id(spec, r, [&] { return id; }, 20.0);
        });
        for (int r = 0; r < world; r++) {
            ASSERT_TRUE(outcomes[size_t(r)].ok) << "rank " << r << ": " << outcomes[size_t(r)].message;
            EXPECT_EQ(outcomes[size_t(r)].id, id) << "rank " << r;
        }
        EXPECT_TRUE(files_in(dir.path()).empty()) << "rank 0 leaves no rendezvous files behind";
    }
}

TEST(FileRendezvous, RankWithoutRankZeroTimesOut) {
    test::TempDir dir("rdv_timeout");
    const auto t0 = std::chrono::steady_clock::now();
    expect_error([&] { file_rendezvous_fetch(dir.path(), "lonely", 2, 4, 0.3); }, kExitError,
                 {"rank 2 waited 0.3 s", dir.path() + "/lonely.id", "is rank 0 running"});
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GE(s, 0.3);
    EXPECT_LT(s, 3.0);
}

TEST(FileRendezvous, RankZeroNamesTheRanksThatNeverCame) {
    test::TempDir dir("rdv_missing");
    const UniqueId id = random_id(99);
    auto outcomes = run_ranks(4, dir.path(), [&](int rank) -> UniqueId {
        if (rank == 0) {
            file_rendezvous_publish(dir.path(), "partial", 4, id, 1.0);
            return id;
        }
        if (rank == 2) return file_rendezvous_fetch(dir.path(), "partial", rank, 4, 5.0);
        return UniqueId{};  // ranks 1 and 3 never join
    });
    ASSERT_FALSE(outcomes[0].ok);
    EXPECT_EQ(outcomes[0].exit_code, kExitError);
    for (const char* part : {"ranks 1, 3 of 4 never read the id", "partial"}) {
        EXPECT_NE(outcomes[0].message.find(part), std::string::npos) << outcomes[0].message;
    }
    EXPECT_TRUE(outcomes[2].ok) << outcomes[2].message;
    EXPECT_EQ(outcomes[2].id, id);
    EXPECT_TRUE(files_in(dir.path()).empty()) << "the id file is removed even after a timeout";
}

TEST(FileRendezvous, StaleAndForeignFilesAreRefused) {
    test::TempDir dir("rdv_stale");
    const std::string path = rendezvous_id_path(dir.path(), "old");
    {
        File f(path, File::Mode::Write);
        f.write_all("x", 1);
    }
    expect_error([&] { file_rendezvous_publish(dir.path(), "old", 2, random_id(1), 1.0); }, kExitUsage,
                 {path, "already exists", "rm '" + path + "'"});
    expect_error([&] { file_rendezvous_fetch(dir.path(), "old", 1, 2, 1.0); }, kExitData, {path, "1 bytes"});
    // An id published for 3 ranks, read by a rank started with 2.
    std::remove(path.c_str());
    auto outcomes = run_ranks(2, dir.path(), [&](int rank) -> UniqueId {
        if (rank == 0) {
            file_rendezvous_publish(dir.path(), "old", 3, random_id(2), 0.5);
            return UniqueId{};
        }
        return file_rendezvous_fetch(dir.path(), "old", 1, 2, 5.0);
    });
    ASSERT_FALSE(outcomes[1].ok);
    EXPECT_NE(outcomes[1].message.find("is for 3 ranks, this rank (1) was started with 2"), std::string::npos)
        << outcomes[1].message;
}

// ------------------------------------------------------------------------------------------------

TEST(TcpRendezvous, EveryRankGetsRankZerosId) {
    for (int world : {2, 5, 8}) {
        test::TempDir dir("rdv_tcp");
        TcpListener listener("127.0.0.1", 0);
        ASSERT_GT(listener.port(), 0);
        const int port = listener.port();
        const UniqueId id = random_id(uint64_t(world) + 1000);
        auto outcomes = run_ranks(world, dir.path(), [&](int rank) -> UniqueId {
            if (rank == 0) {
                std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the others connect first
                tcp_rendezvous_serve(listener, world, id, 20.0);
                return id;
            }
            return tcp_rendezvous_fetch("127.0.0.1", port, rank, world, 20.0);
        });
        for (int r = 0; r < world; r++) {
            ASSERT_TRUE(outcomes[size_t(r)].ok) << "rank " << r << ": " << outcomes[size_t(r)].message;
            EXPECT_EQ(outcomes[size_t(r)].id, id) << "rank " << r;
        }
    }
}

TEST(TcpRendezvous, PeersRetryUntilRankZeroListens) {
    int port = 0;
    {
        TcpListener probe("127.0.0.1", 0);  // a port that was free a moment ago
        port = probe.port();
    }
    test::TempDir dir("rdv_tcp_late");
    const UniqueId id = random_id(7);
    auto outcomes = run_ranks(3, dir.path(), [&](int rank) -> UniqueId {
        if (rank == 0) {
            std::this_thread::sleep_for(std::chrono::milliseconds(500));  // connections are refused meanwhile
            TcpListener listener("127.0.0.1", port);
            tcp_rendezvous_serve(listener, 3, id, 20.0);
            return id;
        }
        return tcp_rendezvous_fetch("127.0.0.1", port, rank, 3, 20.0);
    });
    for (int r = 0; r < 3; r++) {
        ASSERT_TRUE(outcomes[size_t(r)].ok) << "rank " << r << ": " << outcomes[size_t(r)].message;
        EXPECT_EQ(outcomes[size_t(r)].id, id);
    }
}

TEST(TcpRendezvous, TimeoutsNameTheAddressAndTheMissingRanks) {
    int port = 0;
    {
        TcpListener probe("127.0.0.1", 0);
        port = probe.port();
    }
    expect_error([&] { tcp_rendezvous_fetch("127.0.0.1", port, 1, 2, 0.4); }, kExitError,
                 {"rank 1 could not get the id", "tcp://127.0.0.1:" + std::to_string(port), "Connection refused"});
    TcpListener listener("127.0.0.1", 0);
    expect_error([&] { tcp_rendezvous_serve(listener, 3, random_id(3), 0.3); }, kExitError,
                 {"rank 0 waited", "ranks 1, 2 of 3 did not connect", "tcp://127.0.0.1:" + std::to_string(listener.port())});
}

TEST(TcpRendezvous, WorldSizeMismatchFailsOnBothSides) {
    test::TempDir dir("rdv_tcp_world");
    TcpListener listener("127.0.0.1", 0);
    const int port = listener.port();
    auto outcomes = run_ranks(2, dir.path(), [&](int rank) -> UniqueId {
        if (rank == 0) {
            tcp_rendezvous_serve(listener, 2, random_id(4), 10.0);
            return UniqueId{};
        }
        return tcp_rendezvous_fetch("127.0.0.1", port, 1, 4, 10.0);
    });
    ASSERT_FALSE(outcomes[0].ok);
    EXPECT_NE(outcomes[0].message.find("with world size 4, rank 0 has 2"), std::string::npos) << outcomes[0].message;
    ASSERT_FALSE(outcomes[1].ok);
    EXPECT_NE(outcomes[1].message.find("runs 2 ranks, this rank (1) was started with 4"), std::string::npos)
        << outcomes[1].message;
}

TEST(TcpRendezvous, ListenErrorsAreClear) {
    TcpListener first("127.0.0.1", 0);
    expect_error([&] { TcpListener second("127.0.0.1", first.port()); }, kExitError,
                 {"rank 0 cannot listen on 127.0.0.1:" + std::to_string(first.port())});
    expect_error([] { tcp_rendezvous_fetch("no-such-host.invalid", 1234, 1, 2, 0.2); }, kExitUsage,
                 {"cannot resolve host 'no-such-host.invalid'"});
}

TEST(Rendezvous, OneRankNeedsNoMeeting) {
    const UniqueId id = random_id(5);
    int calls = 0;
    const UniqueId got = exchange_unique_id(RendezvousSpec{}, RankInfo{}, [&] {
        calls++;
        return id;
    });
    EXPECT_EQ(got, id);
    EXPECT_EQ(calls, 1);
}
