/*
A race of the file-system rendezvous (llmc/rendezvous.h), made to happen every time: a rank has
acknowledged the id file a killed launch left, and the relaunch's rank 0 replaces that file and removes
the stale acknowledgement between the rank's read of the id file and its look at the acknowledgement.
The rank must then take the new id, not return the dead launch's (NCCL would wait on a rank 0 that is
gone).

The window is a few microseconds wide, so this test widens it: it defines stat() for this program, and
the first look at the stale acknowledgement waits until the new id file is in place. Kept apart from
test_rendezvous.cpp so that no other test runs with stat() replaced.
*/
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "llmc/rendezvous.h"
#include "test/test_util.h"

using namespace llmc;

namespace {

// While armed: the acknowledgement whose first stat() leaves a marker (ACK.looking) and then waits for
// the id file to hold another nonce.
std::string g_hold_ack;
std::string g_id_path;
uint64_t g_old_nonce = 0;
std::atomic<bool> g_armed{false};

int real_stat(const char* path, struct stat* st) { return ::fstatat(AT_FDCWD, path, st, 0); }

uint64_t id_nonce(const std::string& path) {
    rendezvous_detail::RendezvousIdFile f;
    std::string why;
    return rendezvous_detail::read_id_file(path, &f, &why) == rendezvous_detail::IdState::Valid ? f.nonce : 0;
}

UniqueId id_filled_with(char c) {
    UniqueId id;
    id.fill(c);
    return id;
}

}  // namespace

extern "C" int stat(const char* __restrict path, struct stat* __restrict st) noexcept {
    if (g_armed.load() && g_hold_ack == path) {
        g_armed = false;
        std::fclose(std::fopen((g_hold_ack + ".looking").c_str(), "w"));  // rank 0 may come now
        for (int i = 0; i < 1000; i++) {  // up to 10 s for the relaunch's rank 0 to replace the id file
            const uint64_t n = id_nonce(g_id_path);
            if (n != 0 && n != g_old_nonce) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // and to remove the stale acknowledgement
    }
    return real_stat(path, st);
}

TEST(FileRendezvousRace, AReplacementBetweenTheReadAndTheAcknowledgementCheckIsSeen) {
    test::TempDir dir("rdv_race");
    const std::string job = "requeued";
    const std::string path = rendezvous_id_path(dir.path(), job);
    const UniqueId old_id = id_filled_with('o'), new_id = id_filled_with('n');

    // The killed launch: its rank 0 published and died; the id file stays behind.
    const pid_t killed = ::fork();
    ASSERT_GE(killed, 0);
    if (killed == 0) {
        try {
            file_rendezvous_publish(dir.path(), job, 2, old_id, 60.0);
        } catch (...) {
        }
        ::_exit(0);
    }
    for (int i = 0; i < 1000 && id_nonce(path) == 0; i++) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ::kill(killed, SIGKILL);
    ::waitpid(killed, nullptr, 0);
    g_old_nonce = id_nonce(path);
    ASSERT_NE(g_old_nonce, 0u);

    // The relaunch's rank 0 comes when rank 1, having acknowledged the leftover and read it again, looks
    // at its acknowledgement.
    g_id_path = path;
    g_hold_ack = rendezvous_ack_path(dir.path(), job, 1, g_old_nonce);
    const pid_t rank0 = ::fork();
    ASSERT_GE(rank0, 0);
    if (rank0 == 0) {
        int code = 0;
        try {
            struct stat st;
            for (int i = 0; i < 1000 && real_stat((g_hold_ack + ".looking").c_str(), &st) != 0; i++) {
                std::this_thread::sleep_for(std::chrono::milliseconds(10));
            }
            file_rendezvous_publish(dir.path(), job, 2, new_id, 5.0);
        } catch (const Error& e) {
            code = e.exit_code();
        }
        ::_exit(code);
    }
    g_armed = true;
    UniqueId got{};
    std::string error;
    try {
        got = file_rendezvous_fetch(dir.path(), job, 1, 2, 5.0);
    } catch (const Error& e) {
        error = e.what();
    }
    int status = 0;
    ::waitpid(rank0, &status, 0);
    EXPECT_TRUE(error.empty()) << error;
    EXPECT_TRUE(got == new_id) << "rank 1 returned the killed launch's id";
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank 0 of the relaunch did not meet rank 1";
    // The race was made: the stale acknowledgement's look went through this program's stat() (if the
    // rendezvous stops using stat(), this test no longer tests anything and must be redone).
    struct stat st;
    EXPECT_EQ(real_stat((g_hold_ack + ".looking").c_str(), &st), 0) << "the acknowledgement was never looked at "
                                                                        "through stat(): the race was not made";
}
