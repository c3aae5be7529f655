// The shared-memory all-gather of byte blobs among the ranks of one host. Each rank owns one segment (a
// control block and two data slots used by alternate rounds) and maps every peer's segment; a collective
// (`exchange`) runs in rounds until every rank's blob is delivered to every rank. Torch-free: the torch
// binding sizes outputs in on_meta and copies out (padding as it goes) in on_data.
//
// Setup, on every rank:  Group group(options);              // creates this rank's segment
//                         <share group.locator() with every rank>
//                         group.attach_peers(locators);  <barrier>  group.finish_setup();
// then any number of group.exchange(...) calls, in the same order on every rank. Build the callbacks once
// and reuse them: a std::function made from a lambda with large captures allocates on every call.
// A Group is used by one thread at a time, and only in the process that created it (not in a forked child).
#pragma once

#include "shm_error.h"
#include "shm_segment.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace accel::shm {

namespace detail {
struct ControlBlock;
enum class WaitOutcome : int;
}  // namespace detail

struct Options {
  int rank = 0;
  int world = 1;                  // 1..256
  std::string token;              // 16..64 lowercase hex chars, the same on every rank (made by the caller)
  size_t slot_bytes = 8u << 20;   // payload bytes per slot; >= 4096
  std::chrono::milliseconds timeout{30 * 60 * 1000};
  // More ranks on this host than CPUs they can run on: waits stop spinning and yield only briefly before
  // sleeping, so a waiting rank does not hold a core its peer needs.
  bool oversubscribed = false;
};

// "accel-<token>-r<rank>"
std::string segment_name(const std::string& token, int rank);

struct PeerMeta {
  int rank;
  const std::byte* meta;
  size_t meta_size;
  uint64_t data_size;
};
// `size` bytes of a rank's data starting at `offset` within it.
struct PeerChunk {
  int rank;
  uint64_t offset;
  const std::byte* data;
  size_t size;
};
// Copies this rank's data [offset, offset + size) to dst.
using Fill = std::function<void(std::byte* dst, uint64_t offset, size_t size)>;
// Called once per exchange with every rank's meta, in rank order.
using OnMeta = std::function<void(const std::vector<PeerMeta>&)>;
// Called once per round that carries data, with the chunks of every rank that has one (size > 0), in rank
// order. The pointers are into the peers' slots and valid only during the call.
using OnData = std::function<void(const std::vector<PeerChunk>&)>;

class Group {
 public:
  // Creates this rank's segment (memory check, 0600, pages reserved) and initialises its control block.
  explicit Group(const Options& options);
  // Marks this rank aborted ("left the group"), so a peer still waiting on it fails at once instead of at its
  // deadline; a peer that already has what it waits for is not disturbed.
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const std::string& own_segment_name() const;
  // Where peers open this rank's segment; valid until finish_setup().
  Locator locator() const;
  // Maps every other rank's segment through its locator (indexed by rank; this rank's entry is ignored) and
  // checks it belongs to this group (name, magic, layout version, world, rank, slot size); Error{Setup}
  // naming the rank otherwise. Every rank must have constructed its Group first.
  void attach_peers(const std::vector<Locator>& locators);
  // Closes this rank's descriptor: call once every rank has attached. The segment never had a name in a file
  // system, so from creation on nothing can leak: the memory goes away with the last mapping.
  void finish_setup();

  // One collective: every rank passes its own meta (meta_size <= max_meta_bytes()) and data_size (0 to
  // max_data_bytes()). Round 1 carries each rank's sizes, meta and the first part of its data; on_meta runs once all
  // ranks' round 1 is published (so the caller can size outputs), then on_data for round 1's data if any and
  // for each further round until the largest data of all ranks is delivered. The round count depends only on
  // what every rank sent in round 1, so it is the same on all ranks. Nothing is copied on the read side: the
  // metas and chunks point into the peers' slots and are valid only during the callback. on_meta and on_data
  // may be empty; fill only when data_size is 0. Every wait shares one deadline, `timeout` from the start of
  // the call.
  // Throws Error{Timeout, PeerDied, PeerAborted} naming the peer, Error{Corrupt} naming a peer whose sizes
  // cannot be valid, Error{Poisoned} after an earlier failure, Error{Usage} for bad arguments, or whatever a
  // callback threw (rethrown as is; a callback that finds a peer's meta invalid throws Error{Corrupt}). On any
  // error this rank first marks itself aborted, so peers waiting on it fail fast with a message naming the
  // culprit, and the group is poisoned.
  void exchange(const void* meta, size_t meta_size, uint64_t data_size, const Fill& fill, const OnMeta& on_meta,
                const OnData& on_data);
  // Marks this rank aborted with `reason`: peers waiting on it throw Error{PeerAborted}. Poisons the group.
  void abort(const std::string& reason) noexcept;
  // From the next exchange on; 0 gives up at once on a peer that is not there yet.
  void set_timeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds timeout() const;

  // slot_bytes minus round 1's size prefix (16 bytes).
  size_t max_meta_bytes() const;
  // 2^50 bytes (1 PiB): far beyond any real payload, small enough that no size arithmetic can overflow.
  static constexpr uint64_t max_data_bytes() { return uint64_t{1} << 50; }
  int rank() const;
  int world() const;
  size_t slot_bytes() const;
  // Rounds completed since construction, over all exchanges.
  uint64_t rounds() const;

 private:
  using Deadline = std::chrono::steady_clock::time_point;
  using Counter = std::atomic<uint64_t> detail::ControlBlock::*;

  void throw_if_poisoned() const;
  void check_usable_here() const;
  void check_attached() const;
  void attach_peer(int peer, const Locator& locator);
  uint64_t run_first_round(const void* meta, size_t meta_size, uint64_t data_size, const Fill& fill,
                           const OnMeta& on_meta, const OnData& on_data);
  void run_data_round(uint64_t index, const Fill& fill, const OnData& on_data);
  std::byte* begin_round();
  void publish_round();
  void finish_round();
  void wait_for_all(Counter counter, uint64_t target);
  [[noreturn]] void give_up(detail::WaitOutcome outcome, int peer, Counter counter, uint64_t target);
  void read_headers();
  uint64_t rounds_needed() const;
  void deliver_chunks(uint64_t index, const OnData& on_data);
  void fail_from_current_exception() noexcept;
  void mark_aborted(const std::string& reason, int culprit) noexcept;
  void poison(int peer, const std::string& message) noexcept;
  std::byte* slot(int rank, uint64_t round) const;

  Options options_;
  Segment own_segment_;
  detail::ControlBlock* own_;
  std::vector<Segment> peer_segments_;
  std::vector<detail::ControlBlock*> blocks_;  // by rank, this rank's own included
  std::vector<PeerMeta> metas_;                // reused by every exchange: no allocation per round
  std::vector<PeerChunk> chunks_;
  uint64_t round_ = 0;  // last round this rank finished
  Deadline deadline_{};
  Deadline yields_paused_until_{};  // see kSlowYield in wait.h
  const pid_t pid_;                 // the creating process: a forked copy must not touch the segments
  bool aborted_ = false;
  bool poisoned_ = false;
  int poison_peer_ = -1;
  std::string poison_message_;
};

}  // namespace accel::shm
