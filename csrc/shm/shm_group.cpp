// The round protocol. Rounds are numbered from 1 across all exchanges of a group; round e uses slot e % 2
// of every rank's segment. Each rank writes only its own segment (plus the `sleepers` word of a peer it
// sleeps on). For rank r and round e:
//   1. r waits until every rank's `consumed` >= e - 2: all have finished reading r's round e-2, the last
//      round that used this slot (r's own `consumed` is e - 1 already).
//   2. r writes its slot, then `published` = e (release) and wakes sleepers.
//   3. r waits for every rank's `published` >= e (acquire) and reads their slots for round e.
//   4. r sets `consumed` = e (release) and wakes sleepers.
// Why no slot is overwritten while it is read: r reads p's slot for round e only between seeing
// p.published >= e and storing r.consumed = e. p writes that slot next in round e+2, and only after seeing
// r.consumed >= e in step 1; until then p is at most one round ahead (round e+1), which uses the other slot.
// The release/acquire pairs make this a happens-before edge rather than an order of counters: r's reads
// happen before its release store of `consumed`, which p loads with acquire before it writes the slot.
// Today step 3 alone implies the same: p enters round e+2 only after seeing r.published >= e+1, which r
// stores after it finished reading round e, so the step-1 wait never actually blocks (one load per peer).
// It stays because it states the rule where the slot is reused, and it keeps the slot safe should the
// rounds ever be pipelined (publishing round e+1 before round e is read).
#include "shm_group.h"

#include "control_block.h"
#include "wait.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

namespace accel::shm {
namespace {

using detail::ControlBlock;
using detail::WaitOutcome;

constexpr int kMaxWorld = 256;
constexpr size_t kMinSlotBytes = 4096;
// Far beyond any /dev/shm, and small enough that the segment size arithmetic cannot overflow.
constexpr size_t kMaxSlotBytes = size_t{1} << 50;
// Clamps the deadline arithmetic: steady_clock counts nanoseconds in 64 bits (about 292 years).
constexpr std::chrono::hours kLongestTimeout{24 * 365 * 100};

// Round 1 starts every rank's slot with its sizes; the meta follows, then the data from the next cache line.
struct RoundOnePrefix {
  uint64_t meta_size;
  uint64_t data_size;
};
constexpr size_t kPrefixBytes = sizeof(RoundOnePrefix);

// Where round `index` (0-based within an exchange) puts a rank's data, and which part of it.
struct ChunkSpan {
  size_t slot_offset;
  uint64_t offset;
  size_t size;
};

size_t first_data_offset(size_t meta_size) {
  return (kPrefixBytes + meta_size + detail::kCacheLine - 1) / detail::kCacheLine * detail::kCacheLine;
}

uint64_t first_capacity(size_t meta_size, size_t slot_bytes) {
  return slot_bytes - std::min(slot_bytes, first_data_offset(meta_size));
}

ChunkSpan chunk_of(const PeerMeta& meta, uint64_t index, size_t slot_bytes) {
  const uint64_t first = first_capacity(meta.meta_size, slot_bytes);
  if (index == 0) {
    return {first_data_offset(meta.meta_size), 0, static_cast<size_t>(std::min(first, meta.data_size))};
  }
  const uint64_t offset = first + (index - 1) * slot_bytes;
  const uint64_t left = meta.data_size > offset ? meta.data_size - offset : 0;
  return {0, offset, static_cast<size_t>(std::min<uint64_t>(left, slot_bytes))};
}

uint64_t rounds_for(const PeerMeta& meta, size_t slot_bytes) {
  const uint64_t first = first_capacity(meta.meta_size, slot_bytes);
  if (meta.data_size <= first) return 1;
  const uint64_t rest = meta.data_size - first;
  return 1 + rest / slot_bytes + (rest % slot_bytes != 0);
}

[[noreturn]] void throw_usage(const std::string& message) { throw Error(ErrorKind::Usage, -1, message); }

const Options& checked(const Options& options) {
  if (options.world < 1 || options.world > kMaxWorld) {
    throw_usage("shared-memory group: world must be in [1, 256], got " + std::to_string(options.world));
  }
  if (options.rank < 0 || options.rank >= options.world) {
    throw_usage("shared-memory group: rank " + std::to_string(options.rank) + " is outside [0, " +
                std::to_string(options.world) + ")");
  }
  // A valid token is exactly what makes a valid segment name: 16 to 64 lowercase hex digits.
  if (!is_segment_name(segment_name(options.token, 0))) {
    throw_usage("shared-memory group: the token must be 16 to 64 lowercase hex digits, got '" + options.token +
                "'");
  }
  if (options.slot_bytes < kMinSlotBytes || options.slot_bytes > kMaxSlotBytes) {
    throw_usage("shared-memory group: slot_bytes must be in [4096, 2^50], got " +
                std::to_string(options.slot_bytes));
  }
  if (options.timeout.count() < 0) throw_usage("shared-memory group: the timeout must not be negative");
  return options;
}

ControlBlock* init_control_block(const Segment& segment, const Options& options) {
  const pid_t pid = ::getpid();
  return new (segment.data())
      ControlBlock(static_cast<uint32_t>(options.rank), static_cast<uint32_t>(options.world), options.slot_bytes,
                   static_cast<uint32_t>(pid), detail::process_start_time(pid));
}

// Empty when `block` is the control block rank `peer` of this group must have; what differs otherwise.
std::string block_mismatch(const ControlBlock& block, const Options& options, int peer) {
  auto differs = [](const char* field, uint64_t got, uint64_t want) {
    return std::string(field) + " is " + std::to_string(got) + ", expected " + std::to_string(want);
  };
  if (block.magic != detail::kMagic) return "it was not written by accel's shared-memory transport";
  if (block.version != detail::kLayoutVersion) {
    return differs("layout version", block.version, detail::kLayoutVersion);
  }
  if (block.world != static_cast<uint32_t>(options.world)) return differs("world", block.world, options.world);
  if (block.rank != static_cast<uint32_t>(peer)) return differs("rank", block.rank, peer);
  if (block.slot_bytes != options.slot_bytes) return differs("slot_bytes", block.slot_bytes, options.slot_bytes);
  return {};
}

std::string reason_of(const ControlBlock& block) {
  return std::string(block.reason, strnlen(block.reason, sizeof block.reason));
}

}  // namespace

std::string segment_name(const std::string& token, int rank) {
  return "accel-" + token + "-r" + std::to_string(rank);
}

Group::Group(const Options& options)
    : options_(checked(options)),
      own_segment_(Segment::create(segment_name(options_.token, options_.rank),
                                   detail::segment_bytes(options_.slot_bytes))),
      own_(init_control_block(own_segment_, options_)),
      blocks_(options_.world, nullptr),
      metas_(options_.world),
      pid_(::getpid()) {
  blocks_[options_.rank] = own_;
  peer_segments_.reserve(options_.world - 1);
  chunks_.reserve(options_.world);
}

Group::~Group() { mark_aborted("rank " + std::to_string(options_.rank) + " left the group", options_.rank); }

const std::string& Group::own_segment_name() const { return own_segment_.name(); }
Locator Group::locator() const { return own_segment_.locator(); }
size_t Group::max_meta_bytes() const { return options_.slot_bytes - kPrefixBytes; }
int Group::rank() const { return options_.rank; }
int Group::world() const { return options_.world; }
size_t Group::slot_bytes() const { return options_.slot_bytes; }
std::chrono::milliseconds Group::timeout() const { return options_.timeout; }
uint64_t Group::rounds() const { return round_; }

void Group::set_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) throw_usage("shared-memory group: the timeout must not be negative");
  options_.timeout = timeout;
}

void Group::attach_peers(const std::vector<Locator>& locators) {
  check_usable_here();
  throw_if_poisoned();
  if (!peer_segments_.empty()) throw_usage("shared-memory group: attach_peers() was already called");
  if (locators.size() != static_cast<size_t>(options_.world)) {
    throw_usage("shared-memory group: attach_peers() needs one locator per rank (" + std::to_string(options_.world) +
                "), got " + std::to_string(locators.size()));
  }
  try {
    for (int peer = 0; peer < options_.world; ++peer) {
      if (peer != options_.rank) attach_peer(peer, locators[peer]);
    }
  } catch (...) {
    fail_from_current_exception();
    throw;
  }
}

void Group::attach_peer(int peer, const Locator& locator) {
  const std::string prefix = "rank " + std::to_string(options_.rank) + " cannot attach to rank " +
                             std::to_string(peer) + "'s shared-memory segment: ";
  Segment segment = [&] {
    try {
      return Segment::open(locator, segment_name(options_.token, peer), detail::segment_bytes(options_.slot_bytes));
    } catch (const Error& error) {
      throw Error(ErrorKind::Setup, peer, prefix + error.what());
    }
  }();
  auto* block = std::launder(reinterpret_cast<ControlBlock*>(segment.data()));
  const std::string mismatch = block_mismatch(*block, options_, peer);
  if (!mismatch.empty()) throw Error(ErrorKind::Setup, peer, prefix + segment.name() + ": " + mismatch);
  // Waits tell a dead peer by its pid: one that is not visible here (another PID namespace sharing this
  // /dev/shm) would read as dead in the first slow wait, so refuse it now, while a fallback is still cheap.
  if (!detail::process_alive(static_cast<pid_t>(block->pid), block->start_time)) {
    throw Error(ErrorKind::Setup, peer,
                prefix + "its process (pid " + std::to_string(block->pid) +
                    ") is not running as seen from here (it exited, or runs in another PID namespace)");
  }
  blocks_[peer] = block;
  peer_segments_.push_back(std::move(segment));
}

void Group::finish_setup() { own_segment_.close_descriptor(); }

void Group::exchange(const void* meta, size_t meta_size, uint64_t data_size, const Fill& fill,
                     const OnMeta& on_meta, const OnData& on_data) {
  check_usable_here();
  throw_if_poisoned();
  try {
    check_attached();
    if (meta_size > max_meta_bytes()) {
      throw_usage("rank " + std::to_string(options_.rank) + ": meta of " + std::to_string(meta_size) +
                  " bytes exceeds max_meta_bytes() = " + std::to_string(max_meta_bytes()));
    }
    if (data_size > max_data_bytes()) {
      throw_usage("rank " + std::to_string(options_.rank) + ": " + std::to_string(data_size) +
                  " bytes exceed max_data_bytes() = " + std::to_string(max_data_bytes()));
    }
    if (data_size > 0 && !fill) {
      throw_usage("rank " + std::to_string(options_.rank) + ": data to send but no fill function");
    }
    deadline_ = detail::Clock::now() + std::min<detail::Clock::duration>(options_.timeout, kLongestTimeout);
    const uint64_t rounds = run_first_round(meta, meta_size, data_size, fill, on_meta, on_data);
    for (uint64_t index = 1; index < rounds; ++index) run_data_round(index, fill, on_data);
  } catch (...) {
    fail_from_current_exception();
    throw;
  }
}

// Round 1: sizes and meta of every rank, so on_meta can size the outputs, and the first part of the data.
// Returns how many rounds this exchange takes, the same number on every rank.
uint64_t Group::run_first_round(const void* meta, size_t meta_size, uint64_t data_size, const Fill& fill,
                                const OnMeta& on_meta, const OnData& on_data) {
  std::byte* dst = begin_round();
  const RoundOnePrefix prefix{meta_size, data_size};
  std::memcpy(dst, &prefix, kPrefixBytes);
  if (meta_size > 0) std::memcpy(dst + kPrefixBytes, meta, meta_size);
  const ChunkSpan first = chunk_of(PeerMeta{options_.rank, nullptr, meta_size, data_size}, 0, options_.slot_bytes);
  if (first.size > 0) fill(dst + first.slot_offset, 0, first.size);
  publish_round();
  wait_for_all(&ControlBlock::published, round_ + 1);
  read_headers();
  if (on_meta) on_meta(metas_);
  deliver_chunks(0, on_data);
  finish_round();
  return rounds_needed();
}

void Group::run_data_round(uint64_t index, const Fill& fill, const OnData& on_data) {
  std::byte* dst = begin_round();
  const ChunkSpan chunk = chunk_of(metas_[options_.rank], index, options_.slot_bytes);
  if (chunk.size > 0) fill(dst + chunk.slot_offset, chunk.offset, chunk.size);
  publish_round();
  wait_for_all(&ControlBlock::published, round_ + 1);
  deliver_chunks(index, on_data);
  finish_round();
}

// Step 1 of the protocol: the slot of round e was last read in round e-2.
std::byte* Group::begin_round() {
  const uint64_t round = round_ + 1;
  if (round > 2) wait_for_all(&ControlBlock::consumed, round - 2);
  return slot(options_.rank, round);
}

void Group::publish_round() {
  own_->published.store(round_ + 1, std::memory_order_release);
  detail::notify_change(*own_);
}

void Group::finish_round() {
  own_->consumed.store(round_ + 1, std::memory_order_release);
  detail::notify_change(*own_);
  ++round_;
}

// This rank's own counters are always there already: it waits only for peers.
void Group::wait_for_all(Counter counter, uint64_t target) {
  for (int peer = 0; peer < options_.world; ++peer) {
    if (peer == options_.rank) continue;
    ControlBlock& block = *blocks_[peer];
    const detail::Await wait{block, block.*counter, target};
    const WaitOutcome outcome = detail::wait_until(wait, deadline_, yields_paused_until_, options_.oversubscribed);
    if (outcome != WaitOutcome::Reached) give_up(outcome, peer, counter, target);
  }
}

// Marks this rank aborted before throwing, so ranks waiting on it fail fast. An abort seen on a peer is passed
// on with the peer's reason unchanged: that reason names the original culprit, however long the chain.
void Group::give_up(WaitOutcome outcome, int peer, Counter counter, uint64_t target) {
  const ControlBlock& block = *blocks_[peer];
  const std::string me = "rank " + std::to_string(options_.rank);
  const std::string them = "rank " + std::to_string(peer);
  if (outcome == WaitOutcome::PeerAborted) {
    const int culprit = static_cast<int>(block.aborted.load(std::memory_order_acquire)) - 1;
    const std::string root = reason_of(block);
    mark_aborted(root, culprit);
    throw Error(ErrorKind::PeerAborted, culprit, me + " gave up waiting for " + them + ", which aborted: " + root);
  }
  const std::string pid = std::to_string(block.pid);
  if (outcome == WaitOutcome::PeerDied) {
    const std::string message = me + " gave up waiting for " + them + ": " + them + " (pid " + pid +
                                ") died during round " + std::to_string(round_ + 1);
    mark_aborted(message, peer);
    throw Error(ErrorKind::PeerDied, peer, message);
  }
  const char* step = counter == &ControlBlock::published ? " to publish round " : " to finish reading round ";
  const std::string message = me + " timed out after " + std::to_string(options_.timeout.count()) +
                              " ms waiting for " + them + " (pid " + pid + ")" + step + std::to_string(target) +
                              "; it is alive but has not got there (stuck, or calling a different collective?)";
  mark_aborted(message, peer);
  throw Error(ErrorKind::Timeout, peer, message);
}

// The peers' round-1 prefixes, checked before anything trusts them: the meta must stay inside the slot, and
// the data size bounds the round count and every offset computed from it.
void Group::read_headers() {
  for (int peer = 0; peer < options_.world; ++peer) {
    const std::byte* src = slot(peer, round_ + 1);
    RoundOnePrefix prefix;
    std::memcpy(&prefix, src, kPrefixBytes);
    if (prefix.meta_size > max_meta_bytes() || prefix.data_size > max_data_bytes()) {
      throw Error(ErrorKind::Corrupt, peer,
                  "rank " + std::to_string(options_.rank) + " read a corrupt header from rank " +
                      std::to_string(peer) + " (meta of " + std::to_string(prefix.meta_size) + " bytes in a " +
                      std::to_string(options_.slot_bytes) + "-byte slot, data of " +
                      std::to_string(prefix.data_size) + " bytes)");
    }
    metas_[peer] = PeerMeta{peer, src + kPrefixBytes, static_cast<size_t>(prefix.meta_size), prefix.data_size};
  }
}

uint64_t Group::rounds_needed() const {
  uint64_t rounds = 1;
  for (const PeerMeta& meta : metas_) rounds = std::max(rounds, rounds_for(meta, options_.slot_bytes));
  return rounds;
}

void Group::deliver_chunks(uint64_t index, const OnData& on_data) {
  chunks_.clear();  // keeps its capacity (world): no allocation per round
  for (const PeerMeta& meta : metas_) {
    const ChunkSpan chunk = chunk_of(meta, index, options_.slot_bytes);
    if (chunk.size == 0) continue;
    const std::byte* data = slot(meta.rank, round_ + 1) + chunk.slot_offset;
    chunks_.push_back(PeerChunk{meta.rank, chunk.offset, data, chunk.size});
  }
  if (!chunks_.empty() && on_data) on_data(chunks_);
}

std::byte* Group::slot(int rank, uint64_t round) const {
  auto* base = reinterpret_cast<std::byte*>(blocks_[rank]);
  return base + detail::kDataOffset + (round % 2) * detail::slot_stride(options_.slot_bytes);
}

void Group::check_usable_here() const {
  if (::getpid() != pid_) {
    throw_usage("rank " + std::to_string(options_.rank) + ": a shared-memory group cannot be used in a process " +
                "forked from the one that created it (pid " + std::to_string(pid_) + ")");
  }
}

void Group::check_attached() const {
  if (peer_segments_.size() + 1 != static_cast<size_t>(options_.world)) {
    throw_usage("rank " + std::to_string(options_.rank) + ": call attach_peers() before exchange()");
  }
}

void Group::throw_if_poisoned() const {
  if (poisoned_) {
    throw Error(ErrorKind::Poisoned, poison_peer_,
                "rank " + std::to_string(options_.rank) +
                    ": the shared-memory group cannot be used after an earlier failure: " + poison_message_);
  }
}

// Formatting a reason allocates; running out of memory here terminates the process, which peers see as a
// death, so even then no peer waits forever.
void Group::abort(const std::string& reason) noexcept {
  const std::string message = "rank " + std::to_string(options_.rank) + " aborted: " + reason;
  mark_aborted(message, options_.rank);
  poison(options_.rank, message);
}

// Called from a catch block. Errors raised by give_up have marked this rank aborted already; anything else
// (a callback that threw, a usage error) is this rank's own fault, so it blames itself. noexcept as abort().
void Group::fail_from_current_exception() noexcept {
  const std::string failed = "rank " + std::to_string(options_.rank) + " failed during round " +
                             std::to_string(round_ + 1);
  try {
    throw;
  } catch (const Error& error) {
    mark_aborted(error.what(), error.peer() >= 0 ? error.peer() : options_.rank);
    poison(error.peer(), error.what());
  } catch (const std::exception& error) {
    mark_aborted(failed + ": " + error.what(), options_.rank);
    poison(options_.rank, failed + ": " + error.what());
  } catch (...) {
    mark_aborted(failed + " (non-standard exception)", options_.rank);
    poison(options_.rank, failed + " (non-standard exception)");
  }
}

// The reason goes in before the release store of `aborted`, and only once: peers read it without a lock as
// soon as they see the flag.
void Group::mark_aborted(const std::string& reason, int culprit) noexcept {
  if (aborted_ || ::getpid() != pid_) return;  // a forked child has no mapping of the segment to write to
  aborted_ = true;
  const size_t length = std::min(reason.size(), detail::kReasonBytes - 1);
  std::memcpy(own_->reason, reason.data(), length);
  own_->reason[length] = '\0';
  own_->aborted.store(static_cast<uint32_t>(culprit) + 1, std::memory_order_release);
  detail::notify_change(*own_);
}

void Group::poison(int peer, const std::string& message) noexcept {
  if (poisoned_) return;
  poisoned_ = true;
  poison_peer_ = peer;
  poison_message_ = message;
}

}  // namespace accel::shm
