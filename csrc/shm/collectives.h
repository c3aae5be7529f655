// Collectives of byte arrays among the ranks of one host, on a Group's exchanges: the algorithms of accel's
// shared-memory process group (shm_bindings/shm_process_group.cpp binds them to tensors and the reduction kernels).
// Torch-free, so the C++ tests run them as threads and processes under the sanitizers.
//
// Every call is collective: all ranks of the group make the same call (same kind, sizes, root, and the caller's
// dtype, op and factor) in the same order. Each rank's Call travels as its exchange's meta, and every rank checks
// every Call before any data is touched: one that cannot be valid (unknown kind, sizes that disagree with the
// bytes it sends) is a corrupt peer (Error{Corrupt}, the group is poisoned); valid Calls that differ make every
// rank finish the exchange copying nothing and throw CallMismatch, after which the group is still usable.
// Errors of the group itself (a peer died, timed out, aborted) are the Group's Error, as from exchange().
//
// Buffers are caller memory. A call returns when this rank's result is complete; there is no barrier after it
// (the Group's epoch counters keep a slot from being reused before every rank has read it).
#pragma once

#include "shm_group.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace accel::shm {

enum class CallKind : uint32_t {
  AllReduce = 1,  // one-shot all-reduce: `count` elements from every rank
  ReduceSlices,   // sliced all-reduce, first exchange: `count` elements from every rank
  GatherSlices,   // sliced all-reduce, second exchange: the pieces this rank reduced (at most `count` elements)
  Broadcast,      // `count` elements from `root`, nothing from the others
  AllGather,      // `count` elements from every rank
  ReduceScatter,  // world * `count` elements from every rank, `count` reduced into each
  Barrier,        // nothing
  End
};

// What a rank says about its call. The core uses kind, root, count and element_bytes; dtype, op and factor are the
// caller's, compared between ranks but never interpreted here.
struct Call {
  uint32_t kind = 0;  // CallKind
  uint32_t op = 0;
  int64_t dtype = 0;
  int64_t root = 0;
  uint64_t count = 0;
  uint64_t element_bytes = 1;  // a power of two up to 64
  double factor = 1.0;

  bool operator==(const Call& other) const;
};

// Thrown by every rank alike when the ranks' calls disagree; what() names each rank's call.
class CallMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Writes to `out` the reduction of parts[0] .. parts[world - 1] (parts[r] is rank r's data), `count` elements each.
// Must combine the parts in rank order, so that every rank computes the same bits. `out` never overlaps a part.
using Reduce = std::function<void(const std::byte* const* parts, std::byte* out, uint64_t count)>;
// A call as the error for a mismatch shows it; the core's own text (kind, root, sizes) when empty.
using Describe = std::function<std::string(const Call&)>;

class Collectives {
 public:
  // The group's slots must be a multiple of 64 bytes (Error{Usage} otherwise). Error{Usage} from a call: an element
  // size that is not a power of two up to 64, too many elements, a root outside the group (nothing exchanged).
  explicit Collectives(Group& group, Describe describe = {});

  // data (call.count elements) becomes the reduction of every rank's data. Up to one_shot_max_bytes in one
  // exchange where every rank reduces everything; above, a reduce-scatter then an all-gather inside shared memory:
  // each rank reduces 1/world of every round's chunk straight into `data`, then the ranks exchange those pieces.
  // Either way each element is reduced by `reduce` over all ranks' values in rank order.
  void all_reduce(std::byte* data, Call call, const Reduce& reduce, uint64_t one_shot_max_bytes);
  // output (call.count elements) becomes the reduction of every rank's slice `rank` of input (world * call.count
  // elements). Sent interleaved in blocks, so every rank reduces in every round.
  void reduce_scatter(const std::byte* input, std::byte* output, Call call, const Reduce& reduce);
  // data (call.count elements) becomes rank call.root's.
  void broadcast(std::byte* data, Call call);
  // destination(r) (call.count elements) receives rank r's input; this rank's own is copied straight from input
  // (nothing to do when destination(rank) is input itself).
  void all_gather(const std::byte* input, const std::function<std::byte*(int rank)>& destination, Call call);
  void barrier();

  Group& group() const { return group_; }

 private:
  using OnData = std::function<void(const std::vector<PeerChunk>&)>;

  void check(const Call& call) const;
  void run(const Call& call, uint64_t data_size, const Fill& fill, const OnData& on_data);
  void all_reduce_one_shot(std::byte* data, const Call& call, const Reduce& reduce);
  void all_reduce_in_slices(std::byte* data, const Call& call, const Reduce& reduce);
  std::string mismatch(const std::vector<Call>& calls) const;

  Group& group_;
  Describe describe_;
  std::vector<Call> calls_;                // every rank's Call of the current exchange
  std::vector<const std::byte*> parts_;    // every rank's data handed to a Reduce
};

}  // namespace accel::shm
