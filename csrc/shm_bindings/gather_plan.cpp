// The gathers of accel's shared-memory collectives (gather_plan.h).
#include "gather_plan.h"

#include "../dense_values.h"
#include "../pad_into.h"
#include "output_pool.h"

#include <algorithm>
#include <sstream>

namespace accel::transport {
namespace {

std::string shapes_of(const std::vector<RankMeta>& ranks, size_t leaf) {
  std::ostringstream out;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const LeafHeader& header = ranks[r].leaves[leaf];
    out << (r ? ", " : "") << "process " << r << ": " << header.dtype << c10::IntArrayRef(header.sizes);
  }
  return out.str();
}

int64_t product(const std::vector<int64_t>& sizes, size_t begin, size_t end) {
  int64_t result = 1;
  for (size_t d = begin; d < end; ++d) result *= sizes[d];
  return result;
}

}  // namespace

ByteStream byte_stream(at::TensorList leaves) {
  ByteStream stream;
  stream.leaves.reserve(leaves.size());
  stream.starts.reserve(leaves.size() + 1);
  stream.starts.push_back(0);
  for (const at::Tensor& leaf : leaves) {
    stream.leaves.push_back(dense_values(leaf));
    stream.starts.push_back(stream.starts.back() + static_cast<uint64_t>(leaf.nbytes()));
  }
  return stream;
}

void fill_from(const ByteStream& stream, std::byte* dst, uint64_t offset, size_t size) {
  std::vector<Copy> copies;
  auto leaf = std::upper_bound(stream.starts.begin(), stream.starts.end(), offset) - stream.starts.begin() - 1;
  for (uint64_t end = offset + size; offset < end; ++leaf) {
    const uint64_t leaf_end = std::min<uint64_t>(stream.starts[leaf + 1], end);
    const auto* base = static_cast<const std::byte*>(stream.leaves[leaf].const_data_ptr());
    copies.push_back({base + (offset - stream.starts[leaf]), dst, static_cast<size_t>(leaf_end - offset)});
    dst += leaf_end - offset;
    offset = leaf_end;
  }
  run_copies(copies);
}

// A corrupt meta throws (poisoning the group). A rejected plan (ranks that disagree) is kept, not thrown from
// inside the exchange: every rank sees the same metas and rejects them alike, so they can finish the exchange
// (copying nothing) and raise together afterwards, the group intact.
void GatherPlan::on_meta(const std::vector<shm::PeerMeta>& metas) {
  const std::vector<RankMeta> ranks = read_metas(metas, reader_);
  placements_.assign(ranks.size(), {});
  rejection_ = disagreement(ranks);
  if (!rejection_.message.empty()) return;
  for (auto& placements : placements_) placements.resize(ranks[0].leaves.size());
  std::vector<uint64_t> starts(ranks.size(), 0);
  for (size_t leaf = 0; leaf < ranks[0].leaves.size(); ++leaf) plan_leaf(ranks, leaf, starts);
}

Rejection GatherPlan::disagreement(const std::vector<RankMeta>& ranks) const {
  std::string message = call_mismatch(ranks);
  if (!message.empty()) return {message};
  for (size_t r = 1; r < ranks.size(); ++r) {
    if (ranks[r].leaves.size() != ranks[0].leaves.size()) {
      return {"gather: process 0 sends " + std::to_string(ranks[0].leaves.size()) + " tensors but process " +
              std::to_string(r) + " sends " + std::to_string(ranks[r].leaves.size())};
    }
  }
  for (size_t leaf = 0; leaf < ranks[0].leaves.size(); ++leaf) {
    Rejection rejection = leaf_disagreement(ranks, leaf);
    if (!rejection.message.empty()) return rejection;
  }
  return {};
}

// Every rank runs the same checks on the same metas, so all reach the same verdict.
// A call invalid on every rank alike (a 0-d tensor, a dim it lacks) is not a mismatch: it is rejected the same way.
Rejection GatherPlan::leaf_disagreement(const std::vector<RankMeta>& ranks, size_t leaf) const {
  const LeafHeader& first = ranks[0].leaves[leaf];
  if (first.sizes.empty()) return {"gather: tensor " + std::to_string(leaf) + " is 0-d; gather 1-d tensors", false};
  const int64_t ndim = static_cast<int64_t>(first.sizes.size());
  if (pad_dim_ && (*pad_dim_ < -ndim || *pad_dim_ >= ndim)) {
    return {"gather: tensor " + std::to_string(leaf) + " has no dim " + std::to_string(*pad_dim_) + " to pad", false};
  }
  const int64_t dim = pad_dim_ ? c10::maybe_wrap_dim(*pad_dim_, ndim) : 0;
  for (const RankMeta& rank : ranks) {
    const LeafHeader& other = rank.leaves[leaf];
    bool same = other.dtype == first.dtype && other.sizes.size() == first.sizes.size();
    for (size_t d = 1; same && d < first.sizes.size(); ++d) {
      same = static_cast<int64_t>(d) == dim || other.sizes[d] == first.sizes[d];
    }
    if (!same) {
      return {"gather: tensor " + std::to_string(leaf) + " must have the same dtype, number of dims and sizes " +
              "(apart from dim 0" + (dim > 0 ? " and the padded dim" : "") + ") on every process; got " +
              shapes_of(ranks, leaf)};
    }
  }
  return {};
}

void GatherPlan::plan_leaf(const std::vector<RankMeta>& ranks, size_t leaf, std::vector<uint64_t>& starts) {
  const LeafHeader& first = ranks[0].leaves[leaf];
  const int64_t ndim = static_cast<int64_t>(first.sizes.size());
  const int64_t dim = pad_dim_ ? c10::maybe_wrap_dim(*pad_dim_, ndim) : 0;
  int64_t padded = 0, rows = 0;  // the padded size of `dim`, and the output's rows
  for (const RankMeta& rank : ranks) padded = std::max(padded, rank.leaves[leaf].sizes[dim]);
  for (const RankMeta& rank : ranks) {
    const int64_t block_rows = dim == 0 && pad_dim_ ? padded : rank.leaves[leaf].sizes[0];
    TORCH_CHECK(!__builtin_add_overflow(rows, block_rows, &rows), "gather: tensor ", leaf, " is too large");
  }
  std::vector<int64_t> shape = first.sizes;
  shape[0] = rows;
  if (dim > 0) shape[dim] = padded;
  at::Tensor out = fresh_output(shape, at::TensorOptions().dtype(first.dtype));  // at::empty checks numel overflow
  // Blocks and padding are placed by address (tensor views cost a dispatch each, several times the copy at the
  // small sizes of an evaluation loop). In bytes: one index of `dim`, one row of dim 0, one slice along `dim`.
  const int64_t elem = static_cast<int64_t>(out.element_size());
  const int64_t inner = product(shape, dim + 1, shape.size()) * elem;
  const int64_t row_bytes = product(shape, 1, shape.size()) * elem;
  const int64_t slice_bytes = padded * inner;
  auto* base = static_cast<std::byte*>(out.mutable_data_ptr());
  std::optional<PadPattern> pattern;  // the pad value in this leaf's dtype, converted once if any block needs it
  int64_t row = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const LeafHeader& header = ranks[r].leaves[leaf];
    const std::vector<int64_t>& sizes = header.sizes;
    const int64_t block_rows = dim == 0 && pad_dim_ ? padded : sizes[0];
    std::byte* block = base + row * row_bytes;
    const int64_t missing = (dim == 0 ? block_rows : padded) - sizes[dim];
    if (missing > 0) {
      if (!pattern) pattern = pad_pattern(pad_value_, first.dtype);
      // Each slice of the block along `dim` holds `missing` indices of padding, before or after the data.
      const int64_t slices = dim == 0 ? 1 : block_rows * product(shape, 1, dim);
      std::byte* padding = block + (pad_first_ ? 0 : sizes[dim] * inner);
      for (int64_t slice = 0; slice < slices; ++slice) {
        fill_elements(reinterpret_cast<uint8_t*>(padding + slice * slice_bytes), missing * inner / elem, elem,
                      *pattern);
      }
    }
    Placement& p = placements_[r][leaf];
    p.stream_start = starts[r];
    p.bytes = header.bytes;
    p.src_row = static_cast<uint64_t>(sizes[dim] * inner);
    p.dst_row = static_cast<uint64_t>(slice_bytes);
    p.dst = block + (pad_first_ ? missing * inner : 0);
    starts[r] += p.bytes;
    row += block_rows;
  }
  outputs_.push_back(std::move(out));
}

void GatherPlan::on_data(const std::vector<shm::PeerChunk>& chunks) {
  copies_.clear();
  for (const shm::PeerChunk& chunk : chunks) add_copies(chunk.rank, chunk.offset, chunk.data, chunk.size);
  run_copies(copies_);
}

// Splits rank `rank`'s stream bytes [offset, offset + size) into copies to their places in the outputs. The
// stream is exactly the placements' bytes (checked in MetaReader), so every copy lands inside an output.
void GatherPlan::add_copies(int rank, uint64_t offset, const std::byte* data, uint64_t size) {
  const uint64_t end = offset + size;
  for (const Placement& p : placements_[rank]) {
    const uint64_t lo = std::max(offset, p.stream_start), hi = std::min(end, p.stream_start + p.bytes);
    for (uint64_t at = lo; at < hi;) {  // an empty leaf (or one outside the chunk) has lo >= hi
      const uint64_t row = (at - p.stream_start) / p.src_row, col = (at - p.stream_start) % p.src_row;
      const uint64_t bytes = std::min(p.src_row - col, hi - at);
      copies_.push_back({data + (at - offset), p.dst + row * p.dst_row + col, static_cast<size_t>(bytes)});
      at += bytes;
    }
  }
}

}  // namespace accel::transport
