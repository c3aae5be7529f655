// Tests 2 and 3: ranks as forked processes, set up as in production (create, share locators, attach,
// barrier, finish). Randomized exchanges checked byte for byte while /dev/shm holds nothing of the group; a
// rank SIGKILLed inside an exchange, which the others must report (PeerDied, or PeerAborted naming it) fast;
// and what a process forked from a rank (a DataLoader worker) gets: no mapping, and an error if it tries.
// Every child _exits; the parent reaps all of them under a deadline and kills leftovers.
// Not built under TSan (see tests/cpp/CMakeLists.txt).
#include "exchange_check.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <memory>

namespace {

using namespace shm_test;
using accel::shm::Group;
using Clock = std::chrono::steady_clock;

constexpr int kMaxRanks = 8;
constexpr size_t kSlot = 4096;

// What a child tells the parent. Written before the child exits and read after it was reaped.
struct RankReport {
  int kind = -1;  // ErrorKind of the error it got, -1 for none
  int peer = -1;
  int64_t failed_at_ns = 0;  // steady_clock (CLOCK_MONOTONIC): the same clock in every process
  uint64_t rounds = 0;
  char message[512] = {};
};

// One MAP_SHARED | MAP_ANONYMOUS mapping inherited by every child.
struct SharedState {
  std::atomic<int> arrivals{0};  // barrier arrivals so far, over all phases
  std::atomic<int64_t> killed_at_ns{0};
  accel::shm::Locator locators[kMaxRanks];  // each written by its rank before barrier 1
  RankReport reports[kMaxRanks];
};
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free);

class SharedMapping {
 public:
  SharedMapping() {
    void* addr = ::mmap(nullptr, sizeof(SharedState), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(addr != MAP_FAILED);
    state_ = new (addr) SharedState();
  }
  ~SharedMapping() { ::munmap(state_, sizeof(SharedState)); }
  SharedState& operator*() const { return *state_; }
  SharedState* operator->() const { return state_; }

 private:
  SharedState* state_;
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Phase k (counting from 1) completes once every rank has arrived k times.
void barrier(SharedState& shared, int world, int phase) {
  shared.arrivals.fetch_add(1);
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (shared.arrivals.load() < phase * world) {
    CHECK_MSG(Clock::now() < deadline, "barrier " << phase << " timed out");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// The child processes of one test. None outlives it: whatever a failed CHECK skips, the destructor kills
// and reaps every child not reaped yet.
class Children {
 public:
  Children() = default;
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;
  ~Children() {
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (reaped_[i]) continue;
      ::kill(pids_[i], SIGKILL);
      ::waitpid(pids_[i], nullptr, 0);
    }
  }

  // Forks a child that runs body() as `rank` and never returns into the harness: it _exits 0 when body
  // returned, 1 (after printing why) when it threw.
  template <class Body>
  void spawn(int rank, Body body) {
    std::fflush(nullptr);  // or the child would flush the parent's buffered output a second time
    const pid_t pid = ::fork();
    CHECK(pid >= 0);
    if (pid != 0) {
      pids_.push_back(pid);
      reaped_.push_back(false);
      return;
    }
    int status = 1;
    try {
      body();
      status = 0;
    } catch (const std::exception& error) {
      std::fprintf(stderr, "  rank %d (pid %d): %s\n", rank, static_cast<int>(::getpid()), error.what());
    }
    std::fflush(nullptr);
    ::_exit(status);
  }

  // Reaps every child within `limit`, then SIGKILLs and reaps the rest; with `last` >= 0, that child is
  // reaped only after all others (it stays a zombie meanwhile if it died). Returns the wait statuses in
  // spawn order, -1 for a child the harness had to kill.
  std::vector<int> reap_all(Clock::duration limit, int last = -1) {
    std::vector<int> statuses(pids_.size(), -1);
    const auto deadline = Clock::now() + limit;
    for (bool waiting = true; waiting;) {
      waiting = false;
      for (size_t i = 0; i < pids_.size(); ++i) {
        if (reaped_[i]) continue;
        const bool held_back = static_cast<int>(i) == last && others_pending(i);
        if (!held_back) reaped_[i] = ::waitpid(pids_[i], &statuses[i], WNOHANG) == pids_[i];
        waiting |= !reaped_[i];
      }
      if (waiting && Clock::now() >= deadline) return statuses;  // the destructor kills the rest
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return statuses;
  }

 private:
  bool others_pending(size_t except) const {
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (i != except && !reaped_[i]) return true;
    }
    return false;
  }

  std::vector<pid_t> pids_;
  std::vector<bool> reaped_;
};

bool exited_cleanly(int status) { return status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0; }
bool killed_by_sigkill(int status) { return status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL; }

// A child's setup, as the torch binding does it with its own barriers; checks the new segment is 0600.
std::unique_ptr<Group> setup_rank(SharedState& shared, const std::string& token, int rank, int world,
                                  std::chrono::milliseconds timeout) {
  auto group = std::make_unique<Group>(options_for(token, rank, world, kSlot, timeout));
  shared.locators[rank] = group->locator();
  struct stat st {};
  CHECK(::fstat(static_cast<int>(shared.locators[rank].fd), &st) == 0);
  CHECK_MSG((st.st_mode & 0777) == 0600 && st.st_uid == ::geteuid(), "mode " << (st.st_mode & 0777));
  barrier(shared, world, 1);
  group->attach_peers({shared.locators, shared.locators + world});
  barrier(shared, world, 2);
  group->finish_setup();
  barrier(shared, world, 3);
  return group;
}

void forked_exchanges(int world, int exchanges) {
  const std::string token = random_token();
  SharedMapping shared;
  const Workload workload{static_cast<uint64_t>(100 + world), exchanges, /*delays=*/true};
  Children children;
  for (int rank = 0; rank < world; ++rank) {
    children.spawn(rank, [&] {
      const auto group = setup_rank(*shared, token, rank, world, std::chrono::seconds(20));
      shared->reports[rank].rounds = ExchangeChecker(*group, workload).run_all();
    });
  }
  // Nothing of the group is ever in /dev/shm; once every rank has finished setting up (barrier 3), checked
  // while it runs.
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (shared->arrivals.load() < 3 * world && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const std::vector<std::string> during = shm_entries(token);
  const std::vector<int> statuses = children.reap_all(std::chrono::seconds(60));
  for (int rank = 0; rank < world; ++rank) CHECK_MSG(exited_cleanly(statuses[rank]), "rank " << rank << " failed");
  CHECK_MSG(during.empty(), "in /dev/shm while running: " << joined(during));
  for (int rank = 1; rank < world; ++rank) CHECK(shared->reports[rank].rounds == shared->reports[0].rounds);
  CHECK_NO_SHM_LEFT(token);
}

// The victim SIGKILLs itself inside its fill in exchange `kill_at`; the survivors record what they got.
void run_until_killed(Group& group, SharedState& shared, int victim, int kill_at) {
  const int rank = group.rank();
  RankReport& report = shared.reports[rank];
  const uint64_t tag = rank;
  try {
    for (int exchange = 0; exchange < kill_at + 5; ++exchange) {
      const auto fill = [&](std::byte* dst, uint64_t, size_t size) {
        if (rank == victim && exchange == kill_at) {
          shared.killed_at_ns.store(now_ns());
          ::kill(::getpid(), SIGKILL);
        }
        std::memset(dst, 0x11, size);
      };
      group.exchange(&tag, sizeof tag, 3 * kSlot, fill, {}, {});
    }
  } catch (const Error& error) {
    report.failed_at_ns = now_ns();
    report.kind = static_cast<int>(error.kind());
    report.peer = error.peer();
    std::snprintf(report.message, sizeof report.message, "%s", error.what());
    expect_error(ErrorKind::Poisoned, "exchange after the failure",
                 [&] { group.exchange(&tag, sizeof tag, 0, {}, {}, {}); });
  }
}

void check_survivor_report(const RankReport& report, int rank, int victim, int64_t killed_at_ns) {
  const std::string message = report.message;
  CHECK_MSG(report.kind != -1, "rank " << rank << " never failed");
  const auto kind = static_cast<ErrorKind>(report.kind);
  const double latency_s = static_cast<double>(report.failed_at_ns - killed_at_ns) / 1e9;
  std::printf("  rank %d: %s after %.3f s: %s\n", rank, kind_name(kind), latency_s, message.c_str());
  CHECK_MSG(kind == ErrorKind::PeerDied || kind == ErrorKind::PeerAborted, kind_name(kind) << ": " << message);
  CHECK_MSG(report.peer == victim && contains(message, "rank " + std::to_string(victim)), message);
  // Expected: about one futex slice plus one liveness interval (< 0.1 s). The timeout is 5 s, so a bound of
  // 2 s proves the death was detected, not timed out, with room for a loaded machine.
  CHECK_MSG(latency_s >= 0 && latency_s < 2.0, "took " << latency_s << " s");
}

// With `victim_stays_zombie` the parent does not reap the victim until the survivors are done: a zombie
// still answers kill(pid, 0), so they must tell it is dead from /proc.
void killed_peer(int world, int victim, int kill_at, bool victim_stays_zombie) {
  const std::string token = random_token();
  SharedMapping shared;
  Children children;
  for (int rank = 0; rank < world; ++rank) {
    children.spawn(rank, [&] {
      const auto group = setup_rank(*shared, token, rank, world, std::chrono::seconds(5));
      run_until_killed(*group, *shared, victim, kill_at);
    });
  }
  const std::vector<int> statuses = children.reap_all(std::chrono::seconds(30), victim_stays_zombie ? victim : -1);
  CHECK_MSG(killed_by_sigkill(statuses[victim]), "the victim was not killed by its own SIGKILL");
  for (int rank = 0; rank < world; ++rank) {
    if (rank == victim) continue;
    CHECK_MSG(exited_cleanly(statuses[rank]), "rank " << rank << " failed");
    check_survivor_report(shared->reports[rank], rank, victim, shared->killed_at_ns.load());
  }
  CHECK_NO_SHM_LEFT(token);
}

// A process forked from a rank (a DataLoader worker, say) inherits no mapping of any segment (MADV_DONTFORK):
// it can neither write into the slots nor keep them alive. Using the inherited Group is an error, not a crash,
// and destroying it does not disturb the parent's group.
void forked_child_gets_no_mapping() {
  const std::string token = random_token();
  {
    auto group = std::make_unique<Group>(options_for(token, 0, 1, kSlot));
    group->attach_peers({group->locator()});
    group->finish_setup();
    CHECK(mappings(token).size() == 1);  // the parent's
    Children children;
    children.spawn(0, [&] {
      CHECK_MSG(mappings(token).empty(), "the child inherited " << joined(mappings(token)));
      expect_error(ErrorKind::Usage, "an exchange in a forked child", [&] { group->exchange(nullptr, 0, 0, {}, {}, {}); });
      group.reset();
    });
    CHECK(exited_cleanly(children.reap_all(std::chrono::seconds(10))[0]));
    const uint64_t tag = 1;
    group->exchange(&tag, sizeof tag, 0, {}, {}, {});  // the parent's group is intact
  }
  CHECK_NO_SHM_LEFT(token);
}

// A rank whose process is gone by the time the others attach (or whose pid this process cannot see) is a
// setup error naming it, not a death reported later from the middle of an exchange. It leaves nothing behind.
void attach_to_exited_rank() {
  const std::string token = random_token();
  auto options = [&](int rank) { return options_for(token, rank, 2, kSlot); };
  // _exit skips the destructor, as if the child had crashed right after creating its segment.
  SharedMapping shared;
  Children children;
  children.spawn(1, [&] {
    Group group(options(1));
    shared->locators[1] = group.locator();
    ::_exit(0);
  });
  const bool exited = exited_cleanly(children.reap_all(std::chrono::seconds(10))[0]);
  std::string message;
  int peer = -1;
  try {
    Group group(options(0));
    group.attach_peers({group.locator(), shared->locators[1]});
  } catch (const Error& error) {
    CHECK_MSG(error.kind() == ErrorKind::Setup, error.what());
    message = error.what();
    peer = error.peer();
  }
  CHECK(exited);
  CHECK_MSG(peer == 1 && contains(message, "rank 1") && contains(message, "not running"), message);
  CHECK_NO_SHM_LEFT(token);
}

}  // namespace

int main() {
  return run_cases({
      {"forked world 2: randomized exchanges", [] { forked_exchanges(2, 3000); }},
      {"forked world 4: randomized exchanges", [] { forked_exchanges(4, 1500); }},
      {"forked world 3: rank 1 killed mid-exchange", [] { killed_peer(3, 1, 7, false); }},
      {"forked world 4: rank 3 killed mid-exchange", [] { killed_peer(4, 3, 20, false); }},
      {"forked world 3: killed rank 0 left a zombie", [] { killed_peer(3, 0, 5, true); }},
      {"a forked child gets no mapping and cannot use the group", forked_child_gets_no_mapping},
      {"attach to a rank whose process exited", attach_to_exited_rank},
  });
}
