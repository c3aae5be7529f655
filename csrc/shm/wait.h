// How a rank waits for a peer's counter to reach a round: spin briefly, then yield, then sleep on the peer's
// futex word, always under a deadline and watching whether the peer aborted or died. Private to the core.
#pragma once

#include "control_block.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace accel::shm::detail {

using Clock = std::chrono::steady_clock;

// Spinning only pays while the peer is running on another core and about to store; with more ranks than
// cores it steals the peer's time, so it stays at a few microseconds before yielding, then sleeping.
constexpr std::chrono::microseconds kSpinTime{4};
// A peer a few tens of microseconds behind (Python work between collectives, uneven padding) is the common
// case; a futex sleep costs a wake-up latency of that order too, so yield for about as long before sleeping.
constexpr std::chrono::microseconds kYieldTime{100};
// With more ranks than CPUs (Options::oversubscribed): long enough for a peer sharing this core to run and
// publish, short enough not to keep a core from a peer queued on another one.
constexpr std::chrono::microseconds kOversubscribedYieldTime{20};
// A yield that returns this late means another task (not a peer about to publish) had the core for a
// scheduler slice. With the cores oversubscribed (DataLoader workers, other jobs) every yield costs such a
// slice, while a futex sleeper is back within microseconds of its wake-up (the kernel preempts in its
// favour), so the rank stops yielding for a while. Measured with 2 busy processes on 2 cores, 4 ranks as
// threads, 64-byte exchanges: 1.5 ms per exchange when every wait yields, 0.07 ms with the pause; about
// 0.01 ms either way without the busy processes. The pause is short because a one-off slow yield (the
// launcher or a kernel thread waking) is common too: then futex wake-ups cost more than yields. Measured
// with 4 Python ranks on 2 cores doing pad_across_processes + gather of 64 bytes: about 0.3 ms per pair
// without a pause, 0.5 ms with 5 ms, 0.8 ms with 100 ms.
constexpr std::chrono::microseconds kSlowYield{250};
constexpr std::chrono::milliseconds kYieldPause{5};
// Longest futex sleep: bounds how late a death (which wakes nobody) or the deadline is noticed.
constexpr std::chrono::milliseconds kSleepSlice{50};
// kill() and a /proc read cost a handful of syscalls; once per this interval is plenty.
constexpr std::chrono::milliseconds kLivenessInterval{20};

enum class WaitOutcome : int { Reached, PeerAborted, PeerDied, Timeout };

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// The shared (not _PRIVATE) futex ops: the word lives in a MAP_SHARED segment that other processes map at
// other addresses, and only the shared variants key the wait queue on the page rather than the address.
// EAGAIN (the word moved already), ETIMEDOUT and EINTR all just send the waiter back to its checks.
inline void futex_wait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::nanoseconds timeout) noexcept {
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(timeout);
  struct timespec relative {};
  relative.tv_sec = static_cast<time_t>(seconds.count());
  relative.tv_nsec = static_cast<long>((timeout - seconds).count());
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &relative, nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>& word) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Announces a change of the owner's published/consumed/aborted, which the caller stored (release) just
// before. See sleep_once for why the seq_cst pair below cannot lose a wake-up.
inline void notify_change(ControlBlock& own) noexcept {
  own.wake.fetch_add(1, std::memory_order_seq_cst);
  if (own.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(own.wake);
}

// The two fields of /proc/<pid>/stat that tell a live process from a zombie or a recycled pid.
struct ProcessStat {
  bool readable = false;
  char state = '?';
  uint64_t start_time = 0;
};

// Reads into a stack buffer: this runs inside waits, which must not allocate. The command name (field 2)
// may hold spaces and ')' so fields are counted from the last ')'.
inline ProcessStat read_process_stat(pid_t pid) noexcept {
  char path[32];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  char text[1024];
  const ssize_t n = ::read(fd, text, sizeof text - 1);
  ::close(fd);
  if (n <= 0) return {};
  text[n] = '\0';
  const char* field = std::strrchr(text, ')');
  if (field == nullptr || field[1] != ' ') return {};
  ProcessStat stat{true, field[2], 0};
  field += 2;  // field 3, the state
  for (int index = 3; index < 22 && field != nullptr; ++index) {
    field = std::strchr(field, ' ');
    if (field != nullptr) ++field;
  }
  if (field != nullptr) stat.start_time = std::strtoull(field, nullptr, 10);
  return stat;
}

inline uint64_t process_start_time(pid_t pid) noexcept { return read_process_stat(pid).start_time; }

// A zombie still answers kill(pid, 0) (its parent has not reaped it yet), hence the state check; a pid that
// was recycled by a new process shows another start time. Without /proc, kill() has the last word.
inline bool process_alive(pid_t pid, uint64_t start_time) noexcept {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  const ProcessStat stat = read_process_stat(pid);
  if (!stat.readable) return ::kill(pid, 0) == 0 || errno != ESRCH;
  if (stat.state == 'Z' || stat.state == 'X') return false;
  return start_time == 0 || stat.start_time == start_time;
}

// One wait: until `counter` (a field of `peer`) reaches `target`. The acquire load pairs with the peer's
// release store, so everything the peer wrote before publishing that round is visible afterwards.
struct Await {
  ControlBlock& peer;
  const std::atomic<uint64_t>& counter;
  uint64_t target;

  bool reached() const noexcept { return counter.load(std::memory_order_acquire) >= target; }
  bool aborted() const noexcept { return peer.aborted.load(std::memory_order_acquire) != 0; }
};

inline bool spin_until(const Await& wait) noexcept {
  const auto stop = Clock::now() + kSpinTime;
  do {
    for (int i = 0; i < 64; ++i) {
      if (wait.reached()) return true;
      cpu_relax();
    }
  } while (Clock::now() < stop);
  return wait.reached();
}

// Lets a peer that shares this core run, which is cheaper than a futex round trip when it is about to store.
// `paused_until` belongs to the waiting rank and carries a slow-yield pause from one wait to the next.
inline bool yield_until(const Await& wait, Clock::time_point deadline, Clock::time_point& paused_until,
                        std::chrono::microseconds yield_time) noexcept {
  auto now = Clock::now();
  const auto stop = std::min(deadline, now + yield_time);
  while (now < stop && now >= paused_until && !wait.aborted()) {
    if (wait.reached()) return true;
    ::sched_yield();
    const auto before = now;
    now = Clock::now();
    if (now - before > kSlowYield) paused_until = now + kYieldPause;
  }
  return wait.reached();
}

// Dekker-style pairing with notify_change: the sleeper announces itself (seq_cst), reads `wake`, re-checks
// and sleeps only while `wake` still holds the value read. Either the owner's seq_cst load of `sleepers`
// sees the announcement, so it wakes us (FUTEX_WAIT also returns at once when `wake` moved past the value we
// read); or that load precedes our announcement in the single total order, so our load of `wake` comes after
// the owner's increment, synchronises with it, and the re-check sees the new counter. No wake-up is lost.
inline void sleep_once(const Await& wait, std::chrono::nanoseconds slice) noexcept {
  wait.peer.sleepers.fetch_add(1, std::memory_order_seq_cst);
  const uint32_t seen = wait.peer.wake.load(std::memory_order_seq_cst);
  if (!wait.reached() && !wait.aborted()) futex_wait(wait.peer.wake, seen, slice);
  wait.peer.sleepers.fetch_sub(1, std::memory_order_relaxed);
}

// Sleeps in slices, between which it checks (in this order) the counter, the peer's abort flag, its
// liveness (rate-limited, but always before a timeout) and the deadline. Returns why it stopped.
inline WaitOutcome sleep_until(const Await& wait, Clock::time_point deadline) noexcept {
  auto next_liveness_check = Clock::now() + kLivenessInterval;
  for (;;) {
    if (wait.reached()) return WaitOutcome::Reached;
    if (wait.aborted()) return WaitOutcome::PeerAborted;
    const auto now = Clock::now();
    if (now >= next_liveness_check || now >= deadline) {
      if (!process_alive(static_cast<pid_t>(wait.peer.pid), wait.peer.start_time)) return WaitOutcome::PeerDied;
      next_liveness_check = now + kLivenessInterval;
    }
    if (now >= deadline) return wait.reached() ? WaitOutcome::Reached : WaitOutcome::Timeout;
    sleep_once(wait, std::min<Clock::duration>(kSleepSlice, deadline - now));
  }
}

// `oversubscribed`: more ranks than CPUs, so the peer waited for may need this very core. No spinning then,
// and a yield phase cut to kOversubscribedYieldTime: a peer queued on this CPU runs at the first yield, while
// one queued elsewhere gets this CPU once the futex sleep frees it.
inline WaitOutcome wait_until(const Await& wait, Clock::time_point deadline, Clock::time_point& yields_paused_until,
                              bool oversubscribed) noexcept {
  if (wait.reached()) return WaitOutcome::Reached;
  if (oversubscribed) {
    if (yield_until(wait, deadline, yields_paused_until, kOversubscribedYieldTime)) return WaitOutcome::Reached;
  } else if (spin_until(wait) || yield_until(wait, deadline, yields_paused_until, kYieldTime)) {
    return WaitOutcome::Reached;
  }
  return sleep_until(wait, deadline);
}

}  // namespace accel::shm::detail
