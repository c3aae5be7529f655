// Test 6 and the segment itself: names, owner-only mode whatever the umask, sizes, locators, seals, the
// free-memory check, and the setup errors of a group (bad options, missing or mismatched peers). Nothing may be
// left in /dev/shm or mapped by any case.
#include "test_util.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

using namespace shm_test;
using accel::shm::Group;
using accel::shm::Segment;

constexpr unsigned long long kTiB = 1ull << 40;

struct stat stat_of(const accel::shm::Locator& locator) {
  struct stat st {};
  CHECK_MSG(::fstat(static_cast<int>(locator.fd), &st) == 0, "fd " << locator.fd);
  return st;
}

void names() {
  const std::string hex16 = "0123456789abcdef";
  CHECK(accel::shm::segment_name(hex16, 7) == "accel-" + hex16 + "-r7");
  CHECK(accel::shm::is_segment_name("accel-" + hex16 + "-r0"));
  CHECK(accel::shm::is_segment_name("accel-" + hex16 + hex16 + hex16 + hex16 + "-r255"));
  const std::vector<std::string> bad = {
      "/accel-" + hex16 + "-r0",     "accel-" + hex16.substr(1) + "-r0", "accel-" + std::string(65, 'a') + "-r0",
      "accel-0123456789ABCDEF-r0",   "accel-" + hex16 + "-r",            "accel-" + hex16 + "-r1000",
      "accel-" + hex16 + "-r1x",     "accel-" + hex16 + "/../x-r1",      "accel-" + hex16 + "-r-1",
  };
  for (const std::string& name : bad) {
    CHECK_MSG(!accel::shm::is_segment_name(name), name);
    try {
      Segment::create(name, 4096);
      CHECK_MSG(false, "created " << name);
    } catch (const std::invalid_argument& error) {
      CHECK_MSG(contains(error.what(), name), error.what());
    }
  }
}

// Whatever the umask, the segment is exactly 0600, and it never appears in /dev/shm.
void owner_only_whatever_the_umask() {
  const std::string token = random_token();
  for (mode_t mask : {mode_t{0}, mode_t{022}, mode_t{077}, mode_t{0277}}) {
    const mode_t previous = ::umask(mask);
    Segment segment = Segment::create(accel::shm::segment_name(token, 0), 8192);
    ::umask(previous);
    const struct stat st = stat_of(segment.locator());
    CHECK_MSG((st.st_mode & 0777) == 0600, "umask " << mask << " gave mode " << (st.st_mode & 0777));
    CHECK(st.st_uid == ::geteuid());
    CHECK(static_cast<size_t>(st.st_size) == 8192 && segment.size() == 8192);
    CHECK(mappings(token).size() == 1 && dev_shm_entries(token).empty());
  }
  CHECK_NO_SHM_LEFT(token);
}

void create_open_close() {
  const std::string token = random_token();
  const std::string name = accel::shm::segment_name(token, 3);
  {
    Segment created = Segment::create(name, 4096 * 3);
    CHECK(created.name() == name);
    created.data()[100] = std::byte{42};
    const accel::shm::Locator locator = created.locator();
    CHECK(locator.pid == ::getpid() && locator.fd >= 0);
    Segment opened = Segment::open(locator, name, 4096 * 3);
    CHECK(opened.data()[100] == std::byte{42});
    const Error wrong = expect_error(ErrorKind::Setup, "wrong size", [&] { Segment::open(locator, name, 4096); });
    CHECK_MSG(contains(wrong.what(), "12288") && contains(wrong.what(), "4096"), wrong.what());
    const Error other = expect_error(ErrorKind::Setup, "another rank's name", [&] {
      Segment::open(locator, accel::shm::segment_name(token, 4), 4096 * 3);
    });
    CHECK_MSG(contains(other.what(), "not the shared-memory segment"), other.what());
    expect_error(ErrorKind::Usage, "the locator of an opened segment", [&] { opened.locator(); });
    created.close_descriptor();
    created.close_descriptor();  // idempotent
    expect_error(ErrorKind::Usage, "the locator after closing", [&] { created.locator(); });
    const Error gone = expect_error(ErrorKind::Setup, "opening through a closed descriptor",
                                    [&] { Segment::open(locator, name, 4096 * 3); });
    CHECK_MSG(contains(gone.what(), "no longer holds it"), gone.what());
    opened.data()[200] = std::byte{7};  // the mappings outlive the descriptor
    CHECK(created.data()[200] == std::byte{7});
  }
  CHECK_NO_SHM_LEFT(token);
}

// A file at the locator that is not a sealed segment (another program's memfd of the same name) is refused.
void unsealed_segment_is_refused() {
  const std::string token = random_token();
  const std::string name = accel::shm::segment_name(token, 1);
  const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  CHECK(fd >= 0 && ::fchmod(fd, 0600) == 0 && ::ftruncate(fd, 4096) == 0);
  const Error error = expect_error(ErrorKind::Setup, "an unsealed memfd",
                                   [&] { Segment::open({::getpid(), fd}, name, 4096); });
  ::close(fd);
  CHECK_MSG(contains(error.what(), "not sealed"), error.what());
  CHECK_NO_SHM_LEFT(token);
}

// A moved-from segment owns nothing; assigning over a segment releases it.
void destructor_and_move() {
  const std::string token = random_token();
  {
    Segment first = Segment::create(accel::shm::segment_name(token, 0), 4096);
    Segment moved(std::move(first));
    CHECK(first.data() == nullptr && moved.data() != nullptr);
    expect_error(ErrorKind::Usage, "the locator of a moved-from segment", [&] { first.locator(); });
    Segment assigned = Segment::create(accel::shm::segment_name(token, 1), 4096);
    assigned = std::move(moved);  // releases r1
    CHECK(mappings(token).size() == 1);
    CHECK(assigned.name() == accel::shm::segment_name(token, 0));
  }
  CHECK_NO_SHM_LEFT(token);
}

void free_memory_check() {
  const std::string token = random_token();
  const Error direct = expect_error(ErrorKind::Setup, "a 1 TiB segment",
                                    [&] { Segment::create(accel::shm::segment_name(token, 0), kTiB); });
  CHECK_MSG(contains(direct.what(), "MiB of memory") && contains(direct.what(), "ACCEL_TRANSPORT=torch") &&
                contains(direct.what(), "available"),
            direct.what());
  const Error group = expect_error(ErrorKind::Setup, "a group with 1 TiB slots",
                                   [&] { Group group(options_for(token, 0, 2, kTiB)); });
  CHECK_MSG(contains(group.what(), "ACCEL_TRANSPORT=torch"), group.what());
  CHECK_NO_SHM_LEFT(token);
}

void bad_options() {
  const std::string token = random_token();
  for (const std::string& bad_token : {std::string("0123456789ABCDEF"), std::string("0123456789abcde"),
                                       std::string("0123456789abcdeg"), std::string(65, 'a'), std::string("")}) {
    const Error error = expect_error(ErrorKind::Usage, "token '" + bad_token + "'",
                                     [&] { Group group(options_for(bad_token, 0, 1)); });
    CHECK_MSG(contains(error.what(), "token"), error.what());
  }
  expect_error(ErrorKind::Usage, "rank == world", [&] { Group group(options_for(token, 2, 2)); });
  expect_error(ErrorKind::Usage, "negative rank", [&] { Group group(options_for(token, -1, 2)); });
  expect_error(ErrorKind::Usage, "world 0", [&] { Group group(options_for(token, 0, 0)); });
  expect_error(ErrorKind::Usage, "world 257", [&] { Group group(options_for(token, 0, 257)); });
  expect_error(ErrorKind::Usage, "slot below 4096", [&] { Group group(options_for(token, 0, 1, 4095)); });
  Group group(options_for(token, 0, 1));
  expect_error(ErrorKind::Usage, "negative timeout", [&] { group.set_timeout(std::chrono::milliseconds(-1)); });
  expect_error(ErrorKind::Usage, "one locator per rank", [&] { group.attach_peers({}); });
  group.finish_setup();
}

void group_segment_is_owner_only() {
  const std::string token = random_token();
  {
    Group group(options_for(token, 0, 2, 5000));
    const struct stat st = stat_of(group.locator());
    CHECK((st.st_mode & 0777) == 0600 && st.st_uid == ::geteuid());
    CHECK(static_cast<size_t>(st.st_size) >= 4096 + 2 * 5000);
    CHECK(group.max_meta_bytes() == 5000 - 16 && group.slot_bytes() == 5000);
    CHECK(group.world() == 2 && group.rank() == 0 && group.rounds() == 0);
    CHECK(group.own_segment_name() == accel::shm::segment_name(token, 0));
    group.finish_setup();
  }
  CHECK_NO_SHM_LEFT(token);
}

void missing_peer() {
  const std::string token = random_token();
  {
    Group group(options_for(token, 0, 2));
    const accel::shm::Locator nowhere{group.locator().pid, 1000000};  // no such descriptor
    const Error error = expect_error(ErrorKind::Setup, "attaching to a rank that never started",
                                     [&] { group.attach_peers({group.locator(), nowhere}); });
    CHECK(error.peer() == 1);
    CHECK_MSG(contains(error.what(), "rank 1") && contains(error.what(), "not running"), error.what());
    expect_error(ErrorKind::Poisoned, "exchange after a failed attach",
                 [&] { group.exchange(nullptr, 0, 0, {}, {}, {}); });
  }
  CHECK_NO_SHM_LEFT(token);
}

// Rank 1 made with another slot size (so another segment size), or another world (same size).
void mismatched_peer() {
  const std::string token = random_token();
  {
    Group rank0(options_for(token, 0, 2, 4096));
    Group rank1(options_for(token, 1, 2, 8192));
    const Error size = expect_error(ErrorKind::Setup, "a peer with another slot size",
                                    [&] { rank0.attach_peers({rank0.locator(), rank1.locator()}); });
    CHECK(size.peer() == 1);
    CHECK_MSG(contains(size.what(), "rank 1") && contains(size.what(), "bytes, expected"), size.what());
  }
  const std::string token2 = random_token();
  {
    Group rank0(options_for(token2, 0, 2));
    Group rank1(options_for(token2, 1, 3));
    const Error world = expect_error(ErrorKind::Setup, "a peer of another world",
                                     [&] { rank0.attach_peers({rank0.locator(), rank1.locator()}); });
    CHECK(world.peer() == 1);
    CHECK_MSG(contains(world.what(), "world is 3, expected 2"), world.what());
  }
  CHECK_NO_SHM_LEFT(token);
  CHECK_NO_SHM_LEFT(token2);
}

void exchange_before_attach() {
  const std::string token = random_token();
  {
    Group group(options_for(token, 0, 2));
    const Error error = expect_error(ErrorKind::Usage, "exchange before attach_peers",
                                     [&] { group.exchange(nullptr, 0, 0, {}, {}, {}); });
    CHECK_MSG(contains(error.what(), "attach_peers"), error.what());
  }
  CHECK_NO_SHM_LEFT(token);
}

}  // namespace

int main() {
  return run_cases({
      {"segment names", names},
      {"segment is 0600 whatever the umask", owner_only_whatever_the_umask},
      {"create, open, close the descriptor", create_open_close},
      {"an unsealed segment is refused", unsealed_segment_is_refused},
      {"destructor releases, move transfers", destructor_and_move},
      {"free-memory check", free_memory_check},
      {"bad group options", bad_options},
      {"group segment is owner-only", group_segment_is_owner_only},
      {"attach to a missing peer", missing_peer},
      {"attach to a mismatched peer", mismatched_peer},
      {"exchange before attach", exchange_before_attach},
  });
}
