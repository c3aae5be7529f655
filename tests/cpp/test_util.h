// What every shm test shares: a check macro, a case runner, group tokens, /dev/shm scans and the data
// pattern that exchanged bytes are made of and checked against.
#pragma once

#include "shm_group.h"

#include <dirent.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace shm_test {

using accel::shm::Error;
using accel::shm::ErrorKind;

struct CheckFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail_check(const char* file, int line, const char* expression,
                                    const std::string& detail) {
  std::ostringstream out;
  out << file << ":" << line << ": CHECK(" << expression << ") failed";
  if (!detail.empty()) out << ": " << detail;
  throw CheckFailure(out.str());
}

// CHECK_MSG's message is a stream expression: CHECK_MSG(a == b, "a=" << a << " b=" << b).
#define CHECK(condition)                                                              \
  do {                                                                                \
    if (!(condition)) ::shm_test::fail_check(__FILE__, __LINE__, #condition, "");     \
  } while (0)
#define CHECK_MSG(condition, message)                                                 \
  do {                                                                                \
    if (!(condition)) {                                                               \
      std::ostringstream check_detail_;                                               \
      check_detail_ << message;                                                       \
      ::shm_test::fail_check(__FILE__, __LINE__, #condition, check_detail_.str());    \
    }                                                                                 \
  } while (0)

inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

inline const char* kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::Timeout: return "Timeout";
    case ErrorKind::PeerDied: return "PeerDied";
    case ErrorKind::PeerAborted: return "PeerAborted";
    case ErrorKind::Poisoned: return "Poisoned";
    case ErrorKind::Setup: return "Setup";
    case ErrorKind::Usage: return "Usage";
    case ErrorKind::Corrupt: return "Corrupt";
  }
  return "?";
}

// Runs `action`, which must throw accel::shm::Error of `kind`, and returns that error.
template <class Action>
Error expect_error(ErrorKind kind, const std::string& context, Action&& action) {
  try {
    action();
  } catch (const Error& error) {
    CHECK_MSG(error.kind() == kind, context << ": expected a " << kind_name(kind) << " error, got "
                                            << kind_name(error.kind()) << ": " << error.what());
    return error;
  }
  fail_check(__FILE__, __LINE__, "expect_error", context + ": expected a " + kind_name(kind) + " error, got none");
}

struct Case {
  const char* name;
  std::function<void()> run;
};

// Prints every case's name and PASS/FAIL; the exit status of main: nonzero when any case failed.
inline int run_cases(const std::vector<Case>& cases) {
  int failed = 0;
  for (const Case& test_case : cases) {
    std::printf("RUN  %s\n", test_case.name);
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    try {
      test_case.run();
      const auto elapsed = std::chrono::steady_clock::now() - start;
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count();
      std::printf("PASS %s (%lld ms)\n", test_case.name, static_cast<long long>(ms));
    } catch (const std::exception& error) {
      std::printf("FAIL %s: %s\n", test_case.name, error.what());
      ++failed;
    }
    std::fflush(stdout);
  }
  std::printf("%d of %zu cases failed\n", failed, cases.size());
  return failed == 0 ? 0 : 1;
}

// A rank's group options; the rest (oversubscribed) as Options' defaults.
inline accel::shm::Options options_for(const std::string& token, int rank, int world, size_t slot_bytes = 4096,
                                       std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  accel::shm::Options options;
  options.rank = rank;
  options.world = world;
  options.token = token;
  options.slot_bytes = slot_bytes;
  options.timeout = timeout;
  return options;
}

// A fresh group token per test, so runs (and tests) never see each other's segments.
inline std::string random_token() {
  std::random_device device;
  std::string token;
  for (int i = 0; i < 32; ++i) token += "0123456789abcdef"[device() % 16];
  return token;
}

// Entries of /dev/shm named for the group `token`: there must never be any (segments are memfds).
inline std::vector<std::string> dev_shm_entries(const std::string& token) {
  std::vector<std::string> found;
  const std::string prefix = "accel-" + token;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (const dirent* entry = ::readdir(dir)) {
      if (std::strncmp(entry->d_name, prefix.c_str(), prefix.size()) == 0) found.emplace_back(entry->d_name);
    }
    ::closedir(dir);
  }
  return found;
}

// Lines of /proc/self/maps mapping the group's segments: none once every Group and Segment of it is gone.
inline std::vector<std::string> mappings(const std::string& token) {
  std::vector<std::string> found;
  if (std::FILE* maps = std::fopen("/proc/self/maps", "re")) {
    const std::string needle = "/memfd:accel-" + token;
    char line[1024];
    while (std::fgets(line, sizeof line, maps) != nullptr) {
      if (std::strstr(line, needle.c_str()) != nullptr) found.emplace_back(line);
    }
    std::fclose(maps);
  }
  return found;
}

inline std::vector<std::string> shm_entries(const std::string& token) {
  std::vector<std::string> found = dev_shm_entries(token);
  for (std::string& line : mappings(token)) found.push_back(std::move(line));
  return found;
}

inline std::string joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

#define CHECK_NO_SHM_LEFT(token)                          \
  CHECK_MSG(::shm_test::shm_entries(token).empty(), \
            "left in /dev/shm or mapped: " << ::shm_test::joined(::shm_test::shm_entries(token)))

// Exchanged bytes are windows of one fixed random table, starting at a position picked by a seed: any byte
// that lands at the wrong offset, from the wrong rank or the wrong exchange shows. Written and compared with
// memcpy/memcmp, which sanitizers check as ranges (a byte loop would be slow under TSan).
class Pattern {
 public:
  static const Pattern& get() {
    static const Pattern pattern;
    return pattern;
  }

  void write(std::byte* dst, uint64_t seed, uint64_t offset, size_t size) const {
    for_each_window(seed, offset, size, [&](size_t at, const std::byte* window, size_t length) {
      std::memcpy(dst + at, window, length);
      return true;
    });
  }

  bool matches(const std::byte* src, uint64_t seed, uint64_t offset, size_t size) const {
    return for_each_window(seed, offset, size, [&](size_t at, const std::byte* window, size_t length) {
      return std::memcmp(src + at, window, length) == 0;
    });
  }

 private:
  static constexpr size_t kTableBytes = 65521;  // prime, so windows of different seeds rarely line up

  Pattern() : table_(kTableBytes) {
    std::mt19937_64 rng(0x5eed);
    for (std::byte& b : table_) b = static_cast<std::byte>(rng());
  }

  template <class Visit>
  bool for_each_window(uint64_t seed, uint64_t offset, size_t size, Visit&& visit) const {
    size_t position = static_cast<size_t>((seed + offset) % kTableBytes);
    for (size_t done = 0; done < size;) {
      const size_t length = std::min(size - done, kTableBytes - position);
      if (!visit(done, table_.data() + position, length)) return false;
      done += length;
      position = 0;
    }
    return true;
  }

  std::vector<std::byte> table_;
};

}  // namespace shm_test
