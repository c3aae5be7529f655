// Tests 4 and 5, ranks as threads: a rank that stops calling exchange makes the others time out naming it;
// a callback that throws, an explicit abort() or a destroyed Group makes the others fail fast with
// PeerAborted naming the culprit; a peer publishing impossible sizes is reported as corrupt, naming it; after
// any failure the group is poisoned. Runs under TSan.
#include "control_block.h"
#include "thread_ranks.h"

#include <atomic>

namespace {

using namespace shm_test;
using accel::shm::Group;
using accel::shm::PeerChunk;
using accel::shm::PeerMeta;
using Clock = std::chrono::steady_clock;

constexpr size_t kSlot = 4096;

// One exchange of `data_size` zero-free bytes per rank; `hook(where)` runs inside each callback
// ("fill", "meta", "data") so a test can throw or stall there.
void exchange_bytes(Group& group, uint64_t data_size, const std::function<void(const std::string&)>& hook) {
  const uint64_t tag = group.rank() + 1;
  group.exchange(
      &tag, sizeof tag, data_size,
      [&](std::byte* dst, uint64_t, size_t size) {
        hook("fill");
        std::memset(dst, 0x5a, size);
      },
      [&](const std::vector<PeerMeta>&) { hook("meta"); }, [&](const std::vector<PeerChunk>&) { hook("data"); });
}

void no_hook(const std::string&) {}

long long ms_since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

void expect_poisoned(Group& group, const std::string& first_failure) {
  const Error error = expect_error(ErrorKind::Poisoned, "the call after a failure",
                                   [&] { exchange_bytes(group, 100, no_hook); });
  CHECK_MSG(contains(error.what(), first_failure), "Poisoned does not repeat the first failure: " << error.what());
}

// Ranks other than `silent` call exchange with a 300 ms timeout; `silent` never does.
void silent_rank_times_out(int world) {
  const std::string token = random_token();
  const auto timeout = std::chrono::milliseconds(300);
  Groups groups = make_thread_groups(world, token, kSlot, timeout);
  const int silent = world - 1;
  std::atomic<int> timeouts{0};
  run_ranks(world, [&](int rank) {
    if (rank == silent) return;
    const auto start = Clock::now();
    try {
      exchange_bytes(*groups[rank], 3 * kSlot, no_hook);
      CHECK_MSG(false, "rank " << rank << " completed an exchange that rank " << silent << " never joined");
    } catch (const Error& error) {
      const long long elapsed = ms_since(start);
      std::printf("  rank %d: %s after %lld ms: %s\n", rank, kind_name(error.kind()), elapsed, error.what());
      CHECK(error.kind() == ErrorKind::Timeout || error.kind() == ErrorKind::PeerAborted);
      CHECK_MSG(error.peer() == silent, "error names rank " << error.peer());
      CHECK(contains(error.what(), "rank " + std::to_string(silent)));
      CHECK_MSG(elapsed >= 250 && elapsed <= 300 + 1500, "gave up after " << elapsed << " ms");
      timeouts += error.kind() == ErrorKind::Timeout;
      expect_poisoned(*groups[rank], "rank " + std::to_string(silent));
    }
  });
  CHECK(timeouts >= 1);
  groups.clear();
  CHECK_NO_SHM_LEFT(token);
}

// Rank 1 throws from `where` in exchange 3 (data spans several rounds, so every callback runs mid-exchange);
// it must get its own exception back, the others a PeerAborted naming it, and all a Poisoned afterwards.
void throwing_callback(const std::string& where) {
  const std::string token = random_token();
  const int world = 3, culprit = 1, failing_exchange = 3;
  Groups groups = make_thread_groups(world, token, kSlot);
  const std::string boom = "boom from rank 1's " + where;
  run_ranks(world, [&](int rank) {
    Group& group = *groups[rank];
    int exchange = 0;
    try {
      for (; exchange < 6; ++exchange) {
        exchange_bytes(group, 3 * kSlot, [&](const std::string& at) {
          if (rank == culprit && exchange == failing_exchange && at == where) throw std::runtime_error(boom);
        });
      }
      CHECK_MSG(false, "rank " << rank << " never failed");
    } catch (const Error& error) {
      CHECK_MSG(rank != culprit, "the throwing rank got an accel error instead of its own: " << error.what());
      CHECK_MSG(error.kind() == ErrorKind::PeerAborted, kind_name(error.kind()) << ": " << error.what());
      CHECK(error.peer() == culprit);
      CHECK_MSG(contains(error.what(), "rank 1") && contains(error.what(), boom), error.what());
      CHECK_MSG(exchange == failing_exchange || exchange == failing_exchange + 1,
                "failed in exchange " << exchange);
    } catch (const std::runtime_error& error) {
      CHECK(rank == culprit && exchange == failing_exchange && error.what() == boom);
    }
    expect_poisoned(group, boom);
  });
  groups.clear();
  CHECK_NO_SHM_LEFT(token);
}

// Rank 0 aborts (without ever calling exchange) while the others wait for it in an exchange.
void explicit_abort() {
  const std::string token = random_token();
  const int world = 3;
  Groups groups = make_thread_groups(world, token, kSlot);
  run_ranks(world, [&](int rank) {
    Group& group = *groups[rank];
    if (rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      group.abort("stop requested by the test");
    } else {
      const auto start = Clock::now();
      const Error error = expect_error(ErrorKind::PeerAborted, "waiting on an aborted rank",
                                       [&] { exchange_bytes(group, 2 * kSlot, no_hook); });
      CHECK(error.peer() == 0);
      CHECK_MSG(contains(error.what(), "rank 0") && contains(error.what(), "stop requested by the test"),
                error.what());
      CHECK_MSG(ms_since(start) < 5000, "took " << ms_since(start) << " ms");
    }
    expect_poisoned(group, "stop requested by the test");
  });
  groups.clear();
  CHECK_NO_SHM_LEFT(token);
}

// A usage error inside exchange (meta over the limit) is this rank's failure: it aborts, so its peers do
// not wait for it until the timeout.
void oversized_meta_aborts() {
  const std::string token = random_token();
  Groups groups = make_thread_groups(2, token, kSlot);
  run_ranks(2, [&](int rank) {
    Group& group = *groups[rank];
    if (rank == 0) {
      std::vector<std::byte> meta(group.max_meta_bytes() + 1);
      const Error error = expect_error(ErrorKind::Usage, "oversized meta",
                                       [&] { group.exchange(meta.data(), meta.size(), 0, {}, {}, {}); });
      CHECK_MSG(contains(error.what(), "max_meta_bytes"), error.what());
    } else {
      const Error error = expect_error(ErrorKind::PeerAborted, "peer of the oversized meta",
                                       [&] { exchange_bytes(group, 10, no_hook); });
      CHECK(error.peer() == 0);
    }
  });
  groups.clear();
  CHECK_NO_SHM_LEFT(token);
}

// Rank 0 destroys its Group (the process goes on) while the others wait for it: they must not wait until
// their deadline (30 s here).
void destroyed_group_fails_peers_fast() {
  const std::string token = random_token();
  const int world = 3;
  Groups groups = make_thread_groups(world, token, kSlot);
  run_ranks(world, [&](int rank) {
    if (rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      groups[0].reset();
      return;
    }
    const auto start = Clock::now();
    const Error error = expect_error(ErrorKind::PeerAborted, "waiting on a destroyed group",
                                     [&] { exchange_bytes(*groups[rank], 2 * kSlot, no_hook); });
    CHECK(error.peer() == 0);
    CHECK_MSG(contains(error.what(), "rank 0 left the group"), error.what());
    CHECK_MSG(ms_since(start) < 5000, "took " << ms_since(start) << " ms");
  });
  groups.clear();
  CHECK_NO_SHM_LEFT(token);
}

// Rank 1 is a fake: its round 1 is written straight into its segment with sizes no real rank can send. Rank 0
// must refuse them before sizing or copying anything (Corrupt, naming rank 1), and its group is poisoned.
void corrupt_peer_header(uint64_t meta_size, uint64_t data_size) {
  namespace detail = accel::shm::detail;
  const std::string token = random_token();
  {
    Groups groups;
    for (int rank = 0; rank < 2; ++rank) groups.push_back(std::make_unique<Group>(options_for(token, rank, 2, kSlot)));
    const std::vector<accel::shm::Locator> locators{groups[0]->locator(), groups[1]->locator()};
    for (auto& group : groups) group->attach_peers(locators);
    accel::shm::Segment fake =
        accel::shm::Segment::open(locators[1], accel::shm::segment_name(token, 1), detail::segment_bytes(kSlot));
    for (auto& group : groups) group->finish_setup();
    auto* block = reinterpret_cast<detail::ControlBlock*>(fake.data());
    const uint64_t prefix[2] = {meta_size, data_size};
    std::memcpy(fake.data() + detail::kDataOffset + detail::slot_stride(kSlot), prefix, sizeof prefix);  // round 1
    block->published.store(1, std::memory_order_release);
    bool planned = false;
    const Error error = expect_error(ErrorKind::Corrupt, "a fake peer's sizes", [&] {
      exchange_bytes(*groups[0], 10, [&](const std::string& at) { planned = planned || at == "meta"; });
    });
    CHECK(!planned && error.peer() == 1);
    CHECK_MSG(contains(error.what(), "corrupt header from rank 1"), error.what());
    expect_poisoned(*groups[0], "corrupt header from rank 1");
  }
  CHECK_NO_SHM_LEFT(token);
}

}  // namespace

int main() {
  return run_cases({
      {"silent rank times out (world 2)", [] { silent_rank_times_out(2); }},
      {"silent rank times out (world 4)", [] { silent_rank_times_out(4); }},
      {"fill throws", [] { throwing_callback("fill"); }},
      {"on_meta throws", [] { throwing_callback("meta"); }},
      {"on_data throws", [] { throwing_callback("data"); }},
      {"abort() fails waiting peers fast", explicit_abort},
      {"oversized meta aborts the rank", oversized_meta_aborts},
      {"a destroyed group fails its peers fast", destroyed_group_fails_peers_fast},
      {"a peer's impossible meta size is corrupt", [] { corrupt_peer_header(1ull << 40, 0); }},
      {"a peer's impossible data size is corrupt", [] { corrupt_peer_header(8, ~0ull - 100); }},
  });
}
