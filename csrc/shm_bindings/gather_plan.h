// The gathers of accel's shared-memory collectives: this rank's leaves as one byte stream (what it sends), and the
// plan that places every rank's bytes, and the padding, in the outputs (what it receives).
#pragma once

#include "../shm/shm_group.h"
#include "call_meta.h"
#include "copy_pool.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace accel::transport {

// --- the own side: this rank's leaves as one byte stream --------------------------------------------------------

// Contiguous leaves and where each starts in the stream.
struct ByteStream {
  std::vector<at::Tensor> leaves;
  std::vector<uint64_t> starts;  // starts.back() is the total
};

ByteStream byte_stream(at::TensorList leaves);

// Copies stream bytes [offset, offset + size) to dst, leaf by leaf.
void fill_from(const ByteStream& stream, std::byte* dst, uint64_t offset, size_t size);

// --- the gather plan: where each byte of each rank lands ---------------------------------------------------------

// One leaf of one rank inside the output: `rows` blocks of `src_row` bytes, the n-th going to
// dst + n * dst_row (padding occupies the rest of each dst_row).
struct Placement {
  uint64_t stream_start = 0;  // where the leaf starts in the rank's byte stream
  uint64_t bytes = 0;         // its size there
  uint64_t src_row = 0;
  uint64_t dst_row = 0;
  std::byte* dst = nullptr;
};

class GatherPlan {
 public:
  GatherPlan(std::optional<int64_t> pad_dim, const c10::Scalar& pad_value, bool pad_first, int reader)
      : pad_dim_(pad_dim), pad_value_(pad_value), pad_first_(pad_first), reader_(reader) {}

  void on_meta(const std::vector<shm::PeerMeta>& metas);
  void on_data(const std::vector<shm::PeerChunk>& chunks);
  std::vector<at::Tensor> take_outputs() {
    rejection_.raise_if_any();
    return std::move(outputs_);
  }

 private:
  Rejection disagreement(const std::vector<RankMeta>& ranks) const;
  Rejection leaf_disagreement(const std::vector<RankMeta>& ranks, size_t leaf) const;
  void plan_leaf(const std::vector<RankMeta>& ranks, size_t leaf, std::vector<uint64_t>& starts);
  void add_copies(int rank, uint64_t offset, const std::byte* data, uint64_t size);

  std::optional<int64_t> pad_dim_;
  c10::Scalar pad_value_;
  bool pad_first_;
  int reader_;
  std::vector<at::Tensor> outputs_;
  std::vector<std::vector<Placement>> placements_;  // [rank][leaf]
  std::vector<Copy> copies_;
  Rejection rejection_;
};

}  // namespace accel::transport
