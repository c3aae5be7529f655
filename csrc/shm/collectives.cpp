// The collectives of collectives.h on Group::exchange.
//
// all_reduce follows DeepSpeed's shared-memory all-reduce (deepspeed/csrc/cpu/comm/shm.cpp,
// symmetric_naive_all_reduce for small buffers, distributed_naive_reduce for large ones): the scheme is taken, the
// code is not. Small: every rank copies its data into its slot and, once all are published, reduces every rank's
// slot into its own buffer; one round, no barrier after it. Large: in a first exchange each round's chunk is cut
// into world pieces and rank r reduces piece r of every rank's chunk straight into its buffer; in a second each
// rank publishes the pieces it reduced and copies everyone else's. Every element is reduced by exactly one rank
// there, so all ranks end with the same bits, and each rank does 1/world of the arithmetic.
#include "collectives.h"

#include <algorithm>
#include <cstring>
#include <sstream>

namespace accel::shm {
namespace {

constexpr uint64_t kMaxElementBytes = 64;
// The core cuts a round's data at multiples of the cache line when slots are a multiple of it.
constexpr uint64_t kChunkMultiple = 64;
// reduce_scatter sends the input's slices interleaved in blocks of this many bytes (rounded to whole elements).
constexpr uint64_t kBlockBytes = 64 << 10;

// Powers of two up to 64: they divide every chunk a round carries (chunks are multiples of 64 bytes), so no element
// is ever split between two rounds.
bool valid_element_bytes(uint64_t bytes) { return bytes != 0 && bytes <= kMaxElementBytes && (bytes & (bytes - 1)) == 0; }

const char* kind_name(uint32_t kind) {
  static const char* const names[] = {"?",         "all_reduce", "all_reduce", "all_reduce (gather phase)",
                                      "broadcast", "all_gather", "reduce_scatter", "barrier"};
  return kind < static_cast<uint32_t>(CallKind::End) ? names[kind] : "?";
}

std::string core_description(const Call& call) {
  std::ostringstream out;
  out << kind_name(call.kind) << "(" << call.count << " elements of " << call.element_bytes << " bytes, dtype "
      << call.dtype << ", op " << call.op;
  if (call.kind == static_cast<uint32_t>(CallKind::Broadcast)) out << ", root " << call.root;
  out << ")";
  return out.str();
}

[[noreturn]] void corrupt(int self, int peer, const std::string& what) {
  throw Error(ErrorKind::Corrupt, peer,
              "rank " + std::to_string(self) + " read a corrupt call header from rank " + std::to_string(peer) + ": " +
                  what);
}

// The bytes rank `peer` may send with `call`; throws Error{Corrupt} for a Call no valid rank makes. Checked before
// any size a peer gave is used.
uint64_t bytes_sent(const Call& call, int world, int self, int peer) {
  if (call.kind == 0 || call.kind >= static_cast<uint32_t>(CallKind::End)) {
    corrupt(self, peer, "unknown collective " + std::to_string(call.kind));
  }
  if (!valid_element_bytes(call.element_bytes)) {
    corrupt(self, peer, "elements of " + std::to_string(call.element_bytes) + " bytes");
  }
  if (call.root < 0 || call.root >= world) corrupt(self, peer, "root " + std::to_string(call.root));
  const uint64_t copies = call.kind == static_cast<uint32_t>(CallKind::ReduceScatter) ? world : 1;
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(call.count, call.element_bytes * copies, &bytes) || bytes > Group::max_data_bytes()) {
    corrupt(self, peer, std::to_string(call.count) + " elements is too many");
  }
  switch (static_cast<CallKind>(call.kind)) {
    case CallKind::Barrier: return 0;
    case CallKind::Broadcast: return peer == call.root ? bytes : 0;
    default: return bytes;
  }
}

Fill copy_from(const std::byte* source) {
  return [source](std::byte* dst, uint64_t offset, size_t size) { std::memcpy(dst, source + offset, size); };
}

// One contiguous run of a rank's gather-phase stream: `bytes` bytes at `offset` of the buffer. A rank's stream is
// its runs, in order.
struct Run {
  uint64_t offset;
  uint64_t bytes;
};

// Calls fn(buffer offset, offset relative to `begin`, bytes) for the runs' parts in stream range [begin, begin+size).
template <typename Fn>
void for_stream_range(const std::vector<Run>& runs, uint64_t begin, uint64_t size, const Fn& fn) {
  uint64_t start = 0;  // stream offset of the current run
  const uint64_t end = begin + size;
  for (const Run& run : runs) {
    const uint64_t lo = std::max(begin, start), hi = std::min(end, start + run.bytes);
    if (lo < hi) fn(run.offset + (lo - start), lo - begin, hi - lo);
    start += run.bytes;
    if (start >= end) return;
  }
}

// reduce_scatter's stream: the input holds world slices of `slice` bytes, sent as block j of slice 0, block j of
// slice 1, ..., then block j + 1, so every round carries about as much of every rank's slice.
struct Interleaved {
  uint64_t slice;
  uint64_t block;  // whole elements
  int world;

  // Calls fn(slice index, offset within the slice, offset relative to `begin`, bytes) for [begin, begin + size).
  template <typename Fn>
  void for_range(uint64_t begin, uint64_t size, const Fn& fn) const {
    const uint64_t row_bytes = block * world;
    for (uint64_t at = begin, end = begin + size; at < end;) {
      const uint64_t row = at / row_bytes, in_row = at % row_bytes;
      const uint64_t width = std::min(block, slice - row * block);  // the last row's blocks may be shorter
      const uint64_t rank = in_row / width, in_block = in_row % width;
      const uint64_t bytes = std::min(width - in_block, end - at);
      fn(static_cast<int>(rank), row * block + in_block, at - begin, bytes);
      at += bytes;
    }
  }
};

// Ranks that agreed on a call send equally long data, so every rank's chunk of a round starts at the same offset.
uint64_t common_offset(const std::vector<PeerChunk>& chunks, int world) {
  if (chunks.size() != static_cast<size_t>(world)) throw std::logic_error("a round without every rank's chunk");
  for (const PeerChunk& chunk : chunks) {
    if (chunk.offset != chunks[0].offset || chunk.size != chunks[0].size) throw std::logic_error("uneven chunks");
  }
  return chunks[0].offset;
}

}  // namespace

bool Call::operator==(const Call& other) const {
  return kind == other.kind && op == other.op && dtype == other.dtype && root == other.root && count == other.count &&
         element_bytes == other.element_bytes && std::memcmp(&factor, &other.factor, sizeof factor) == 0;
}

Collectives::Collectives(Group& group, Describe describe)
    : group_(group), describe_(std::move(describe)), calls_(group.world()), parts_(group.world()) {
  if (group.slot_bytes() % kChunkMultiple != 0) {
    throw Error(ErrorKind::Usage, -1,
                "shared-memory collectives need slots of a multiple of 64 bytes, got " +
                    std::to_string(group.slot_bytes()));
  }
}

// A caller's own mistakes, refused before anything is exchanged (the group stays usable).
void Collectives::check(const Call& call) const {
  if (!valid_element_bytes(call.element_bytes)) {
    throw Error(ErrorKind::Usage, -1,
                "shared-memory collectives move elements of 1, 2, 4, ... 64 bytes, got " +
                    std::to_string(call.element_bytes));
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(call.count, call.element_bytes * group_.world(), &bytes) ||
      bytes > Group::max_data_bytes()) {
    throw Error(ErrorKind::Usage, -1, std::to_string(call.count) + " elements is too many");
  }
  if (call.root < 0 || call.root >= group_.world()) {
    throw Error(ErrorKind::Usage, -1, "root " + std::to_string(call.root) + " is not a rank of the group");
  }
}

// One exchange: every rank's Call validated and compared with this rank's before on_data sees any data.
void Collectives::run(const Call& call, uint64_t data_size, const Fill& fill, const OnData& on_data) {
  std::string rejection;
  const int self = group_.rank(), world = group_.world();
  auto on_meta = [&](const std::vector<PeerMeta>& metas) {
    for (const PeerMeta& peer : metas) {
      if (peer.meta_size != sizeof(Call)) corrupt(self, peer.rank, "a header of the wrong size");
      Call& theirs = calls_[peer.rank];
      std::memcpy(&theirs, peer.meta, sizeof(Call));
      const uint64_t expected = bytes_sent(theirs, world, self, peer.rank);
      const bool at_most = theirs.kind == static_cast<uint32_t>(CallKind::GatherSlices);
      if (at_most ? peer.data_size > expected : peer.data_size != expected) {
        corrupt(self, peer.rank, "it sends " + std::to_string(peer.data_size) + " bytes with its header");
      }
    }
    for (const Call& theirs : calls_) {
      if (!(theirs == calls_[0])) {
        rejection = mismatch(calls_);
        return;
      }
    }
  };
  group_.exchange(&call, sizeof call, data_size, fill, on_meta, [&](const std::vector<PeerChunk>& chunks) {
    if (rejection.empty() && on_data) on_data(chunks);
  });
  if (!rejection.empty()) throw CallMismatch(rejection);
}

std::string Collectives::mismatch(const std::vector<Call>& calls) const {
  std::string message = "the ranks called different collectives:";
  for (size_t r = 0; r < calls.size(); ++r) {
    message += (r ? ", rank " : " rank ") + std::to_string(r) + " " +
               (describe_ ? describe_(calls[r]) : core_description(calls[r]));
  }
  return message;
}

void Collectives::all_reduce(std::byte* data, Call call, const Reduce& reduce, uint64_t one_shot_max_bytes) {
  check(call);
  if (call.count * call.element_bytes <= one_shot_max_bytes || group_.world() == 1) {
    call.kind = static_cast<uint32_t>(CallKind::AllReduce);
    all_reduce_one_shot(data, call, reduce);
  } else {
    call.kind = static_cast<uint32_t>(CallKind::ReduceSlices);
    all_reduce_in_slices(data, call, reduce);
  }
}

// In place is safe: round k reads (fill) then writes (reduce) the bytes of chunk k only, after they were copied out.
void Collectives::all_reduce_one_shot(std::byte* data, const Call& call, const Reduce& reduce) {
  const int world = group_.world();
  run(call, call.count * call.element_bytes, copy_from(data), [&](const std::vector<PeerChunk>& chunks) {
    const uint64_t offset = common_offset(chunks, world);
    for (const PeerChunk& chunk : chunks) parts_[chunk.rank] = chunk.data;
    reduce(parts_.data(), data + offset, chunks[0].size / call.element_bytes);
  });
}

void Collectives::all_reduce_in_slices(std::byte* data, const Call& call, const Reduce& reduce) {
  const int self = group_.rank(), world = group_.world();
  const uint64_t element = call.element_bytes;
  std::vector<std::vector<Run>> pieces(world);  // every rank's reduced pieces, in the order it sends them
  run(call, call.count * element, copy_from(data), [&](const std::vector<PeerChunk>& chunks) {
    const uint64_t offset = common_offset(chunks, world), elements = chunks[0].size / element;
    for (int r = 0; r < world; ++r) {
      const uint64_t lo = elements * r / world, hi = elements * (r + 1) / world;
      if (hi > lo) pieces[r].push_back({offset + lo * element, (hi - lo) * element});
    }
    const uint64_t lo = elements * self / world, hi = elements * (self + 1) / world;
    if (hi == lo) return;
    for (const PeerChunk& chunk : chunks) parts_[chunk.rank] = chunk.data + lo * element;
    reduce(parts_.data(), data + offset + lo * element, hi - lo);
  });
  uint64_t own_bytes = 0;
  for (const Run& run : pieces[self]) own_bytes += run.bytes;
  Call gather = call;
  gather.kind = static_cast<uint32_t>(CallKind::GatherSlices);
  run(gather, own_bytes,
      [&](std::byte* dst, uint64_t offset, size_t size) {
        for_stream_range(pieces[self], offset, size,
                         [&](uint64_t at, uint64_t into, uint64_t bytes) { std::memcpy(dst + into, data + at, bytes); });
      },
      [&](const std::vector<PeerChunk>& chunks) {
        for (const PeerChunk& chunk : chunks) {
          if (chunk.rank == self) continue;
          for_stream_range(pieces[chunk.rank], chunk.offset, chunk.size, [&](uint64_t at, uint64_t from, uint64_t bytes) {
            std::memcpy(data + at, chunk.data + from, bytes);
          });
        }
      });
}

void Collectives::reduce_scatter(const std::byte* input, std::byte* output, Call call, const Reduce& reduce) {
  check(call);
  call.kind = static_cast<uint32_t>(CallKind::ReduceScatter);
  const int self = group_.rank(), world = group_.world();
  const uint64_t element = call.element_bytes;
  const Interleaved stream{call.count * element, std::max<uint64_t>(kBlockBytes / element, 1) * element, world};
  run(call, stream.slice * world,
      [&](std::byte* dst, uint64_t offset, size_t size) {
        stream.for_range(offset, size, [&](int rank, uint64_t at, uint64_t into, uint64_t bytes) {
          std::memcpy(dst + into, input + rank * stream.slice + at, bytes);
        });
      },
      [&](const std::vector<PeerChunk>& chunks) {
        const uint64_t offset = common_offset(chunks, world);
        stream.for_range(offset, chunks[0].size, [&](int rank, uint64_t at, uint64_t from, uint64_t bytes) {
          if (rank != self) return;
          for (const PeerChunk& chunk : chunks) parts_[chunk.rank] = chunk.data + from;
          reduce(parts_.data(), output + at, bytes / element);
        });
      });
}

void Collectives::broadcast(std::byte* data, Call call) {
  check(call);
  call.kind = static_cast<uint32_t>(CallKind::Broadcast);
  const bool sending = group_.rank() == call.root;
  run(call, sending ? call.count * call.element_bytes : 0, sending ? copy_from(data) : Fill{},
      [&](const std::vector<PeerChunk>& chunks) {
        if (sending) return;
        for (const PeerChunk& chunk : chunks) std::memcpy(data + chunk.offset, chunk.data, chunk.size);
      });
}

void Collectives::all_gather(const std::byte* input, const std::function<std::byte*(int rank)>& destination,
                             Call call) {
  check(call);
  call.kind = static_cast<uint32_t>(CallKind::AllGather);
  const int self = group_.rank();
  const uint64_t bytes = call.count * call.element_bytes;
  run(call, bytes, copy_from(input), [&](const std::vector<PeerChunk>& chunks) {
    for (const PeerChunk& chunk : chunks) {
      if (chunk.rank != self) std::memcpy(destination(chunk.rank) + chunk.offset, chunk.data, chunk.size);
    }
  });
  std::byte* own = destination(self);
  if (own != input && bytes > 0) std::memmove(own, input, bytes);
}

void Collectives::barrier() {
  Call call;
  call.kind = static_cast<uint32_t>(CallKind::Barrier);
  run(call, 0, {}, {});
}

}  // namespace accel::shm
