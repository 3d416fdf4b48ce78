/*
CPU tests of llmc/rendezvous.h: rank detection from flags and from the environments of mpirun
(OpenMPI), MVAPICH, PMI launchers (MPICH, Intel MPI), torchrun-style launchers and Slurm, alone and
nested the way clusters nest them; the GPU a rank picks; the parsing of --rendezvous; and the two ways
of handing NCCL's unique id around, run between real processes (fork): the file-system rendezvous in a
temporary directory and the TCP one on a port the system picks. Every rank must end with rank 0's id;
a rank whose peers never come must fail by its deadline with a message that names the path or address
and the missing ranks; files left by a killed launch must not stop (or slow) a relaunch under the same
job name; rank 0 must listen on every interface, and a peer must retry a name that does not resolve.
*/
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
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

// Starts fn() in a child process that exits when it returns or throws; the caller kills or reaps it.
template <class F>
pid_t spawn(F&& fn) {
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
        try {
            fn();
        } catch (...) {
        }
        ::_exit(0);
    }
    return pid;
}

// Waits (up to 10 s) until path exists.
bool wait_for_file(const std::string& path) {
    for (int i = 0; i < 1000; i++) {
        if (std::filesystem::exists(path)) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
}

// A launch that was killed: rank 0 published `job` for `world` ranks and died (kill -9) while it
// waited; its id file stays behind, written by a process that no longer runs.
void killed_launch(const std::string& dir, const std::string& job, int world) {
    const pid_t pid = spawn([&] { file_rendezvous_publish(dir, job, world, random_id(4242), 60.0); });
    ASSERT_TRUE(wait_for_file(rendezvous_id_path(dir, job)));
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    ASSERT_TRUE(std::filesystem::exists(rendezvous_id_path(dir, job)));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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

TEST(DetectRanks, MvapichPmiAndTorchrun) {
    const RankInfo mv = detect_ranks({}, env_of({{"MV2_COMM_WORLD_RANK", "6"},
                                                 {"MV2_COMM_WORLD_SIZE", "8"},
                                                 {"MV2_COMM_WORLD_LOCAL_RANK", "2"},
                                                 {"MV2_COMM_WORLD_LOCAL_SIZE", "4"},
                                                 {"MPIRUN_ID", "5150"}}));
    EXPECT_EQ(mv.rank, 6);
    EXPECT_EQ(mv.world, 8);
    EXPECT_EQ(mv.local_rank, 2);
    EXPECT_FALSE(mv.single_node);
    EXPECT_EQ(mv.launcher, "mvapich");
    EXPECT_EQ(mv.job, "mvapich-5150");

    // MPICH's or Intel MPI's mpiexec (Hydra).
    const RankInfo pmi = detect_ranks({}, env_of({{"PMI_RANK", "3"},
                                                  {"PMI_SIZE", "4"},
                                                  {"MPI_LOCALRANKID", "3"},
                                                  {"MPI_LOCALNRANKS", "4"}}));
    EXPECT_EQ(pmi.rank, 3);
    EXPECT_EQ(pmi.world, 4);
    EXPECT_EQ(pmi.local_rank, 3);
    EXPECT_TRUE(pmi.single_node);
    EXPECT_EQ(pmi.launcher, "pmi");
    EXPECT_EQ(pmi.job, "llmc");

    const RankInfo tr = detect_ranks({}, env_of({{"RANK", "13"},
                                                 {"WORLD_SIZE", "16"},
                                                 {"LOCAL_RANK", "5"},
                                                 {"LOCAL_WORLD_SIZE", "8"},
                                                 {"TORCHELASTIC_RUN_ID", "none"},
                                                 {"MASTER_ADDR", "node-3"},
                                                 {"MASTER_PORT", "29500"}}));
    EXPECT_EQ(tr.rank, 13);
    EXPECT_EQ(tr.world, 16);
    EXPECT_EQ(tr.local_rank, 5);
    EXPECT_FALSE(tr.single_node);
    EXPECT_EQ(tr.launcher, "torchrun");
    EXPECT_EQ(tr.job, "torchrun-none-node-3-29500");
    const RankInfo tr1 = detect_ranks({}, env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                                                  {"LOCAL_WORLD_SIZE", "2"}}));
    EXPECT_TRUE(tr1.single_node);
    EXPECT_EQ(tr1.job, "torchrun");
}

TEST(DetectRanks, NestedLaunchersPickTheOneThatStartedTheProcess) {
    // mpiexec (Hydra) under Slurm starts one helper per node with srun: the ranks inherit the helper's
    // SLURM_PROCID (the node's index) and SLURM_NTASKS (the node count); PMI_RANK is the real rank.
    const RankInfo hydra = detect_ranks({}, env_of({{"PMI_RANK", "9"},
                                                    {"PMI_SIZE", "16"},
                                                    {"MPI_LOCALRANKID", "1"},
                                                    {"MPI_LOCALNRANKS", "8"},
                                                    {"SLURM_PROCID", "1"},
                                                    {"SLURM_NTASKS", "2"},
                                                    {"SLURM_LOCALID", "0"},
                                                    {"SLURM_JOB_ID", "77"}}));
    EXPECT_EQ(hydra.launcher, "pmi");
    EXPECT_EQ(hydra.rank, 9);
    EXPECT_EQ(hydra.world, 16);
    EXPECT_EQ(hydra.local_rank, 1);
    // torchrun started by srun on each node: the same.
    const RankInfo tr = detect_ranks({}, env_of({{"RANK", "10"},
                                                 {"WORLD_SIZE", "16"},
                                                 {"LOCAL_RANK", "2"},
                                                 {"LOCAL_WORLD_SIZE", "8"},
                                                 {"SLURM_PROCID", "1"},
                                                 {"SLURM_NTASKS", "2"},
                                                 {"SLURM_LOCALID", "0"}}));
    EXPECT_EQ(tr.launcher, "torchrun");
    EXPECT_EQ(tr.rank, 10);
    EXPECT_EQ(tr.local_rank, 2);
    // srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE but no MPI_LOCALRANKID: Slurm's own variables give the GPU.
    const RankInfo pmi2 = detect_ranks({}, env_of({{"PMI_RANK", "5"},
                                                   {"PMI_SIZE", "8"},
                                                   {"PMI_JOBID", "88.0"},
                                                   {"SLURM_PROCID", "5"},
                                                   {"SLURM_NTASKS", "8"},
                                                   {"SLURM_LOCALID", "1"},
                                                   {"SLURM_STEP_NUM_NODES", "2"},
                                                   {"SLURM_JOB_ID", "88"},
                                                   {"SLURM_STEP_ID", "0"}}));
    EXPECT_EQ(pmi2.launcher, "slurm");
    EXPECT_EQ(pmi2.rank, 5);
    EXPECT_EQ(pmi2.local_rank, 1);
    EXPECT_EQ(pmi2.job, "slurm-88.0");
}

TEST(DetectRanks, SeveralRanksWithoutAKnownGpuOrWorldAreRefused) {
    // PMI without a local rank and outside Slurm: which GPU is unknown.
    expect_error([] { detect_ranks({}, env_of({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}})); }, kExitUsage,
                 {"pmi says this is rank 1 of 2", "MPI_LOCALRANKID is not set", "--local-rank"});
    expect_error([] { detect_ranks({}, env_of({{"RANK", "1"}, {"WORLD_SIZE", "4"}})); }, kExitUsage,
                 {"torchrun says this is rank 1 of 4", "LOCAL_RANK is not set"});
    // ... unless --local-rank says it.
    RankFlags f;
    f.local_rank = 1;
    const RankInfo r = detect_ranks(f, env_of({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}}));
    EXPECT_EQ(r.rank, 1);
    EXPECT_EQ(r.world, 2);
    EXPECT_EQ(r.local_rank, 1);
    // A rank without a world size would otherwise run as rank 0 of 1, writing what every other one writes.
    for (const char* var : {"RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK", "OMPI_COMM_WORLD_RANK"}) {
        expect_error([&] { detect_ranks({}, env_of({{var, "2"}})); }, kExitUsage,
                     {std::string(var) + "=2 says this is one of several ranks", "is not set"});
    }
    // One rank needs no local rank; rank 0 alone is harmless.
    EXPECT_EQ(detect_ranks({}, env_of({{"WORLD_SIZE", "1"}, {"RANK", "0"}})).world, 1);
    EXPECT_EQ(detect_ranks({}, env_of({{"RANK", "0"}})).world, 1);
}

TEST(DetectRanks, LocalRankAloneChoosesTheGpu) {
    RankFlags f;
    f.local_rank = 3;
    const RankInfo one = detect_ranks(f, env_of({}));
    EXPECT_EQ(one.rank, 0);
    EXPECT_EQ(one.world, 1);
    EXPECT_EQ(one.local_rank, 3);
    const RankInfo slurm =
        detect_ranks(f, env_of({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}}));
    EXPECT_EQ(slurm.rank, 1);
    EXPECT_EQ(slurm.local_rank, 3) << "the flag overrides the launcher's local rank";
}

TEST(DeviceForRank, LocalRankOrTheOnlyVisibleGpu) {
    RankInfo r;
    r.rank = 5;
    r.world = 8;
    r.local_rank = 5;
    EXPECT_EQ(device_for_rank(r, 8), 5);
    // A launcher that shows each rank only its own GPU (CUDA_VISIBLE_DEVICES per rank, --gpus-per-task=1).
    EXPECT_EQ(device_for_rank(r, 1), 0);
    expect_error([&] { device_for_rank(r, 4); }, kExitUsage,
                 {"rank 5 has local rank 5", "this node has 4 GPUs", "CUDA_VISIBLE_DEVICES"});
    expect_error([&] { device_for_rank(r, 0); }, kExitCuda, {"no GPU is visible"});
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

TEST(FileRendezvous, AHugeTimeoutIsNotAnExpiredOne) {
    // 1e10 s in nanoseconds is past the clock's range: the deadline must not wrap into the past.
    test::TempDir dir("rdv_huge");
    const pid_t pid = spawn([&] { file_rendezvous_fetch(dir.path(), "huge", 1, 2, 1e10); });
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), 0) << "rank 1 gave up at once";
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
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

TEST(FileRendezvous, RelaunchAfterAKilledLaunchMeetsPromptly) {
    test::TempDir dir("rdv_relaunch");
    const std::string job = "requeued";
    killed_launch(dir.path(), job, 3);
    // What more a killed launch can leave: acknowledgements (with and without a nonce) and the temporary
    // id file of a rank 0 killed while writing it.
    pid_t dead = spawn([] {});
    ::waitpid(dead, nullptr, 0);
    for (const std::string& name : {job + ".ack.2", job + ".ack.1.00000000deadbeef", job + ".ack.2.0123456789abcdef",
                                   job + ".id.tmp." + std::to_string(dead)}) {
        File f(dir / name, File::Mode::Write);
        f.write_all("x", 1);
    }
    // The relaunch: ranks 1 and 2 start first and find the leftover id (they must not take it); rank 0
    // comes 300 ms later.
    const UniqueId id = random_id(31);
    const auto t0 = std::chrono::steady_clock::now();
    auto outcomes = run_ranks(3, dir.path(), [&](int rank) -> UniqueId {
        RankInfo r;
        r.rank = rank;
        r.world = 3;
        r.job = job;
        if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        return exchange_unique_id(parse_rendezvous(dir.path()), r, [&] { return id; }, 20.0);
    });
    const double s = seconds_since(t0);
    for (int r = 0; r < 3; r++) {
        ASSERT_TRUE(outcomes[size_t(r)].ok) << "rank " << r << ": " << outcomes[size_t(r)].message;
        EXPECT_EQ(outcomes[size_t(r)].id, id) << "rank " << r << " took the killed launch's id";
    }
    EXPECT_LT(s, 5.0) << "the relaunch waited for something";
    EXPECT_TRUE(files_in(dir.path()).empty()) << "the leftovers are cleared";
}

TEST(FileRendezvous, LeftoversOfOtherWorldSizesAndUnreadableFilesAreReplaced) {
    test::TempDir dir("rdv_leftover");
    killed_launch(dir.path(), "a", 5);
    {
        File f(rendezvous_id_path(dir.path(), "b"), File::Mode::Write);
        f.write_all("x", 1);  // e.g. a file of an older format
    }
    for (const std::string& job : {std::string("a"), std::string("b")}) {
        const UniqueId id = random_id(job[0]);
        auto outcomes = run_ranks(2, dir.path(), [&](int rank) -> UniqueId {
            if (rank == 0) {
                std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 1 reads the leftover first
                file_rendezvous_publish(dir.path(), job, 2, id, 10.0);
                return id;
            }
            return file_rendezvous_fetch(dir.path(), job, 1, 2, 10.0);
        });
        for (int r = 0; r < 2; r++) {
            ASSERT_TRUE(outcomes[size_t(r)].ok) << job << " rank " << r << ": " << outcomes[size_t(r)].message;
            EXPECT_EQ(outcomes[size_t(r)].id, id) << job;
        }
    }
    EXPECT_TRUE(files_in(dir.path()).empty());
}

TEST(FileRendezvous, ALeftoverWithoutItsRankZeroIsNeverConfirmed) {
    test::TempDir dir("rdv_orphan");
    killed_launch(dir.path(), "orphan", 2);
    const auto t0 = std::chrono::steady_clock::now();
    expect_error([&] { file_rendezvous_fetch(dir.path(), "orphan", 1, 2, 0.5); }, kExitError,
                 {"rank 1 waited", "was never confirmed", "no longer running", "orphan.id"});
    EXPECT_GE(seconds_since(t0), 0.5);
    EXPECT_EQ(files_in(dir.path()), std::vector<std::string>{"orphan.id"}) << "the rank takes its acknowledgement back";
}

TEST(FileRendezvous, ARunThatIsStillGoingIsNotDisturbed) {
    test::TempDir dir("rdv_live");
    const std::string path = rendezvous_id_path(dir.path(), "busy");
    const pid_t live = spawn([&] { file_rendezvous_publish(dir.path(), "busy", 2, random_id(8), 30.0); });
    ASSERT_TRUE(wait_for_file(path));
    const std::vector<char> before = [&] {
        std::ifstream in(path, std::ios::binary);
        return std::vector<char>(std::istreambuf_iterator<char>(in), {});
    }();
    expect_error([&] { file_rendezvous_publish(dir.path(), "busy", 2, random_id(9), 5.0); }, kExitUsage,
                 {path, "still going", "process " + std::to_string(live), "--rendezvous-job"});
    std::ifstream in(path, std::ios::binary);
    EXPECT_EQ(std::vector<char>(std::istreambuf_iterator<char>(in), {}), before) << "the running launch's file is kept";
    ::kill(live, SIGKILL);
    ::waitpid(live, nullptr, 0);
}

TEST(FileRendezvous, WorldSizeMismatchFailsPromptlyOnBothSides) {
    test::TempDir dir("rdv_world");
    const auto t0 = std::chrono::steady_clock::now();
    auto outcomes = run_ranks(2, dir.path(), [&](int rank) -> UniqueId {
        if (rank == 0) {
            file_rendezvous_publish(dir.path(), "mixed", 3, random_id(2), 20.0);
            return UniqueId{};
        }
        return file_rendezvous_fetch(dir.path(), "mixed", 1, 2, 20.0);
    });
    EXPECT_LT(seconds_since(t0), 5.0);
    ASSERT_FALSE(outcomes[0].ok);
    EXPECT_EQ(outcomes[0].exit_code, kExitUsage);
    EXPECT_NE(outcomes[0].message.find("rank 1 was started with a world size of 2, rank 0 with 3"), std::string::npos)
        << outcomes[0].message;
    ASSERT_FALSE(outcomes[1].ok);
    EXPECT_EQ(outcomes[1].exit_code, kExitUsage);
    EXPECT_NE(outcomes[1].message.find("is for 3 ranks, this rank (1) was started with 2"), std::string::npos)
        << outcomes[1].message;
    EXPECT_TRUE(files_in(dir.path()).empty());
}

// ------------------------------------------------------------------------------------------------

TEST(TcpRendezvous, EveryRankGetsRankZerosId) {
    for (int world : {2, 5, 8}) {
        test::TempDir dir("rdv_tcp");
        TcpListener listener("127.0.0.1", 0);
        ASSERT_GT(listener.port, 0);
        const int port = listener.port;
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
        port = probe.port;
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
        port = probe.port;
    }
    expect_error([&] { tcp_rendezvous_fetch("127.0.0.1", port, 1, 2, 0.4); }, kExitError,
                 {"rank 1 could not get the id", "tcp://127.0.0.1:" + std::to_string(port), "Connection refused"});
    TcpListener listener("127.0.0.1", 0);
    expect_error([&] { tcp_rendezvous_serve(listener, 3, random_id(3), 0.3); }, kExitError,
                 {"rank 0 waited", "ranks 1, 2 of 3 did not connect", "tcp://127.0.0.1:" + std::to_string(listener.port)});
}

TEST(TcpRendezvous, WorldSizeMismatchFailsOnBothSides) {
    test::TempDir dir("rdv_tcp_world");
    TcpListener listener("127.0.0.1", 0);
    const int port = listener.port;
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

TEST(TcpRendezvous, RankZeroListensOnEveryInterface) {
    // The host in tcp://HOST:PORT is where the others connect; rank 0 must not listen only on the address
    // that name resolves to on its own node (127.0.1.1 for its host name on many systems).
    TcpListener listener("127.0.0.1", 0);
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ASSERT_EQ(::getsockname(listener.sock.fd(), reinterpret_cast<sockaddr*>(&bound), &len), 0);
    if (bound.ss_family == AF_INET6) {
        const in6_addr a = reinterpret_cast<sockaddr_in6*>(&bound)->sin6_addr;
        EXPECT_TRUE(IN6_IS_ADDR_UNSPECIFIED(&a));
    } else {
        ASSERT_EQ(bound.ss_family, AF_INET);
        EXPECT_EQ(reinterpret_cast<sockaddr_in*>(&bound)->sin_addr.s_addr, htonl(INADDR_ANY));
    }
    // A peer that reaches rank 0's node by another of its addresses gets the id.
    test::TempDir dir("rdv_tcp_any");
    const int port = listener.port;
    const UniqueId id = random_id(21);
    auto outcomes = run_ranks(3, dir.path(), [&](int rank) -> UniqueId {
        if (rank == 0) {
            tcp_rendezvous_serve(listener, 3, id, 20.0);
            return id;
        }
        return tcp_rendezvous_fetch(rank == 1 ? "127.0.0.2" : "localhost", port, rank, 3, 20.0);
    });
    for (int r = 0; r < 3; r++) {
        ASSERT_TRUE(outcomes[size_t(r)].ok) << "rank " << r << ": " << outcomes[size_t(r)].message;
        EXPECT_EQ(outcomes[size_t(r)].id, id);
    }
}

TEST(TcpRendezvous, ListenErrorsAreClear) {
    TcpListener first("127.0.0.1", 0);
    expect_error([&] { TcpListener second("127.0.0.1", first.port); }, kExitError,
                 {"rank 0 cannot listen on port " + std::to_string(first.port), "every interface",
                  "tcp://127.0.0.1:" + std::to_string(first.port), "in use"});
}

TEST(TcpRendezvous, AHostThatDoesNotResolveIsRetriedUntilTheDeadline) {
    const auto t0 = std::chrono::steady_clock::now();
    expect_error([] { tcp_rendezvous_fetch("no-such-host.invalid", 1234, 1, 2, 0.5); }, kExitError,
                 {"rank 1 could not get the id", "cannot resolve host 'no-such-host.invalid'"});
    EXPECT_GE(seconds_since(t0), 0.5) << "a failed name lookup ended the wait early";
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
