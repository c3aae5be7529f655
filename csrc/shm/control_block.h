// The control block at offset 0 of every rank's segment, and where the data slots sit after it. Private to
// the transport core.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace accel::shm::detail {

// "accelshm" read as a little-endian u64; a segment without it was not made by this transport.
constexpr uint64_t kMagic = 0x6d6873'6c65636361ull;
// Bump whenever the layout below or the round protocol changes: ranks of different builds then refuse to
// attach instead of misreading each other.
constexpr uint32_t kLayoutVersion = 2;
constexpr size_t kCacheLine = 64;
constexpr size_t kReasonBytes = 512;
// Slots start on their own page, so a slot's hot lines never share a line with the control block.
constexpr size_t kDataOffset = 4096;

// Peers in other processes run the atomic instructions on the same bytes: a lock-based fallback would be a
// lock private to each process, i.e. no atomicity at all.
static_assert(std::atomic<uint64_t>::is_always_lock_free, "64-bit atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "32-bit atomics must be lock-free");
// The kernel sees the futex word as a plain u32.
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word must be 4 bytes");

struct ControlBlock {
  // Line 0: written by the creator before any peer maps the segment, immutable afterwards.
  alignas(kCacheLine) uint64_t magic;
  uint32_t version;
  uint32_t rank;
  uint32_t world;
  uint32_t pid;
  // The owner's start time from /proc (0 when unknown): a dead owner whose pid was recycled still reads dead.
  uint64_t start_time;
  uint64_t slot_bytes;

  // Each hot word on its own line: the owner stores the counters, while peers poll them and bump
  // `sleepers`, and none of that should bounce the others' lines.
  // Last round whose data in this rank's slot is complete (rounds count from 1; 0 = none).
  alignas(kCacheLine) std::atomic<uint64_t> published{0};
  // Last round in which this rank finished reading every rank's slot.
  alignas(kCacheLine) std::atomic<uint64_t> consumed{0};
  // Futex word, bumped after every change of published, consumed or aborted.
  alignas(kCacheLine) std::atomic<uint32_t> wake{0};
  // Peers sleeping (or about to) on `wake`: the only word peers write, so the owner can skip FUTEX_WAKE.
  alignas(kCacheLine) std::atomic<uint32_t> sleepers{0};
  // 0 while healthy; once the owner gave up, 1 + the rank it blames. `reason` (NUL-terminated) is written
  // once, before the release store that sets this, and never again.
  alignas(kCacheLine) std::atomic<uint32_t> aborted{0};
  char reason[kReasonBytes] = {};

  ControlBlock(uint32_t rank_, uint32_t world_, uint64_t slot_bytes_, uint32_t pid_, uint64_t start_time_)
      : magic(kMagic),
        version(kLayoutVersion),
        rank(rank_),
        world(world_),
        pid(pid_),
        start_time(start_time_),
        slot_bytes(slot_bytes_) {}
};
static_assert(sizeof(ControlBlock) <= kDataOffset, "the control block must fit before the data slots");

// Slots are cache-line aligned so that the second one does not share a line with the end of the first.
constexpr size_t slot_stride(size_t slot_bytes) { return (slot_bytes + kCacheLine - 1) / kCacheLine * kCacheLine; }
constexpr size_t segment_bytes(size_t slot_bytes) { return kDataOffset + 2 * slot_stride(slot_bytes); }

}  // namespace accel::shm::detail
