// The torch side of the shared-memory transport (csrc/shm/ is the torch-free protocol): group handles, and
// the collectives that move CPU tensors through one Group::exchange each.
//
// shm_all_gather sends, per rank, a header per leaf (dtype, shape) as the exchange's meta and the leaves'
// unpadded bytes as its data. Every rank reads all headers, sizes the outputs, fills their padding, and copies
// each peer's bytes straight from the peer's slot into the final output: two copies per byte (into the own
// slot, out of the peers' slots), in parallel when a round carries enough bytes to pay for the threads.
#include "../shm/shm_group.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <optional>
#include <unordered_map>
#include <vector>

namespace accel {
namespace {

// --- group handles: Python holds an integer, the groups live here ----------------------------------------------

struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<shm::Group>> groups;
  int64_t next_id = 1;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

std::shared_ptr<shm::Group> group_for(int64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto found = r.groups.find(handle);
  TORCH_CHECK(found != r.groups.end(), "accel shared-memory transport: no group with handle ", handle,
              " (destroyed, or created in another process)");
  return found->second;
}

// shm::Error and std errors become c10::Error, so Python sees a RuntimeError carrying the protocol's message.
template <typename Body>
auto translating_errors(Body body) -> decltype(body()) {
  try {
    return body();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& error) {
    TORCH_CHECK(false, error.what());
  }
}

int64_t shm_group_create(int64_t rank, int64_t world, c10::string_view token, int64_t slot_bytes,
                         double timeout_s) {
  TORCH_CHECK(timeout_s > 0, "accel shared-memory transport: timeout must be positive, got ", timeout_s);
  shm::Options options;
  options.rank = static_cast<int>(rank);
  options.world = static_cast<int>(world);
  options.token = std::string(token);
  options.slot_bytes = static_cast<size_t>(slot_bytes);
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  auto group = translating_errors([&] { return std::make_shared<shm::Group>(options); });
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.groups.emplace(r.next_id, std::move(group));
  return r.next_id++;
}

void shm_group_attach(int64_t handle) {
  translating_errors([&] { group_for(handle)->attach_peers(); });
}

void shm_group_unlink(int64_t handle) {
  translating_errors([&] { group_for(handle)->unlink_own(); });
}

void shm_group_destroy(int64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.groups.erase(handle);
}

// --- copies: plans of (src, dst, bytes), run on one thread or many ----------------------------------------------

struct Copy {
  const std::byte* src;
  std::byte* dst;
  size_t bytes;
};

// Below ~1 MiB per round, waking the thread pool costs more than the copies; above, pieces of 256 KiB.
constexpr size_t kParallelBytes = 1 << 20;
constexpr size_t kPieceBytes = 256 << 10;

void run_copies(const std::vector<Copy>& copies) {
  size_t total = 0;
  for (const Copy& c : copies) total += c.bytes;
  if (total < kParallelBytes || at::get_num_threads() == 1) {
    for (const Copy& c : copies) std::memcpy(c.dst, c.src, c.bytes);
    return;
  }
  std::vector<Copy> pieces;
  for (const Copy& c : copies) {
    for (size_t done = 0; done < c.bytes; done += kPieceBytes) {
      pieces.push_back({c.src + done, c.dst + done, std::min(kPieceBytes, c.bytes - done)});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
  });
}

// --- headers: the meta of one rank is [leaf count, then per leaf: dtype, ndim, sizes...] as int64 -------------

struct LeafHeader {
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
};

std::vector<int64_t> encode_headers(const std::vector<at::Tensor>& leaves) {
  std::vector<int64_t> words{static_cast<int64_t>(leaves.size())};
  for (const at::Tensor& leaf : leaves) {
    words.push_back(static_cast<int64_t>(leaf.scalar_type()));
    words.push_back(leaf.dim());
    words.insert(words.end(), leaf.sizes().begin(), leaf.sizes().end());
  }
  return words;
}

std::vector<LeafHeader> decode_headers(const shm::PeerMeta& meta) {
  std::vector<int64_t> words(meta.meta_size / sizeof(int64_t));
  std::memcpy(words.data(), meta.meta, words.size() * sizeof(int64_t));
  std::vector<LeafHeader> leaves(static_cast<size_t>(words.at(0)));
  size_t at = 1;
  for (LeafHeader& leaf : leaves) {
    leaf.dtype = static_cast<at::ScalarType>(words.at(at));
    const auto ndim = static_cast<size_t>(words.at(at + 1));
    leaf.sizes.assign(words.begin() + at + 2, words.begin() + at + 2 + ndim);
    at += 2 + ndim;
  }
  return leaves;
}

int64_t product(const std::vector<int64_t>& sizes, size_t begin, size_t end) {
  int64_t result = 1;
  for (size_t d = begin; d < end; ++d) result *= sizes[d];
  return result;
}

// --- the own side: this rank's leaves as one byte stream --------------------------------------------------------

// Contiguous leaves and where each starts in the stream.
struct ByteStream {
  std::vector<at::Tensor> leaves;
  std::vector<uint64_t> starts;  // starts.back() is the total
};

ByteStream byte_stream(const std::vector<at::Tensor>& leaves) {
  ByteStream stream;
  stream.starts.push_back(0);
  for (const at::Tensor& leaf : leaves) {
    stream.leaves.push_back(leaf.contiguous());
    stream.starts.push_back(stream.starts.back() + static_cast<uint64_t>(leaf.nbytes()));
  }
  return stream;
}

// Copies stream bytes [offset, offset + size) to dst, leaf by leaf.
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
  GatherPlan(std::optional<int64_t> pad_dim, const c10::Scalar& pad_value, bool pad_first)
      : pad_dim_(pad_dim), pad_value_(pad_value), pad_first_(pad_first) {}

  void on_meta(const std::vector<shm::PeerMeta>& metas);
  void on_data(const std::vector<shm::PeerChunk>& chunks);
  std::vector<at::Tensor> take_outputs() {
    if (rejection_) std::rethrow_exception(rejection_);
    return std::move(outputs_);
  }

 private:
  void plan(const std::vector<shm::PeerMeta>& metas);
  void check_agreement(const std::vector<std::vector<LeafHeader>>& ranks, size_t leaf, int64_t dim) const;
  void plan_leaf(const std::vector<std::vector<LeafHeader>>& ranks, size_t leaf, std::vector<uint64_t>& starts);
  void add_copies(int rank, uint64_t offset, const std::byte* data, uint64_t size);

  std::optional<int64_t> pad_dim_;
  c10::Scalar pad_value_;
  bool pad_first_;
  std::vector<at::Tensor> outputs_;
  std::vector<std::vector<Placement>> placements_;  // [rank][leaf]
  std::vector<Copy> copies_;
  std::exception_ptr rejection_;
};

// A rejected plan (ranks that disagree) is kept, not thrown from inside the exchange: throwing there would
// abort the shared-memory group for good, while every rank sees the same headers and rejects them alike, so
// they can finish the exchange (copying nothing) and raise together afterwards, the group intact.
void GatherPlan::on_meta(const std::vector<shm::PeerMeta>& metas) {
  try {
    plan(metas);
  } catch (const c10::Error&) {
    rejection_ = std::current_exception();
    placements_.assign(metas.size(), {});
    outputs_.clear();
  }
}

void GatherPlan::plan(const std::vector<shm::PeerMeta>& metas) {
  std::vector<std::vector<LeafHeader>> ranks;
  for (const shm::PeerMeta& meta : metas) ranks.push_back(decode_headers(meta));
  for (size_t r = 1; r < ranks.size(); ++r) {
    TORCH_CHECK(ranks[r].size() == ranks[0].size(), "gather: process 0 sends ", ranks[0].size(),
                " tensors but process ", r, " sends ", ranks[r].size());
  }
  placements_.assign(ranks.size(), std::vector<Placement>(ranks[0].size()));
  std::vector<uint64_t> starts(ranks.size(), 0);
  for (size_t leaf = 0; leaf < ranks[0].size(); ++leaf) plan_leaf(ranks, leaf, starts);
}

std::string shapes_of(const std::vector<std::vector<LeafHeader>>& ranks, size_t leaf) {
  std::ostringstream out;
  for (size_t r = 0; r < ranks.size(); ++r) {
    out << (r ? ", " : "") << "process " << r << ": " << ranks[r][leaf].dtype << c10::IntArrayRef(ranks[r][leaf].sizes);
  }
  return out.str();
}

// Every rank runs the same checks on the same headers, so all raise together (nobody is left waiting).
void GatherPlan::check_agreement(const std::vector<std::vector<LeafHeader>>& ranks, size_t leaf, int64_t dim) const {
  const LeafHeader& first = ranks[0][leaf];
  for (const auto& rank : ranks) {
    const LeafHeader& other = rank[leaf];
    bool same = other.dtype == first.dtype && other.sizes.size() == first.sizes.size();
    for (size_t d = 1; same && d < first.sizes.size(); ++d) {
      same = static_cast<int64_t>(d) == dim || other.sizes[d] == first.sizes[d];
    }
    TORCH_CHECK(same, "gather: tensor ", leaf, " must have the same dtype, number of dims and sizes (apart from dim 0",
                dim > 0 ? " and the padded dim" : "", ") on every process; got ", shapes_of(ranks, leaf));
  }
}

void GatherPlan::plan_leaf(const std::vector<std::vector<LeafHeader>>& ranks, size_t leaf,
                           std::vector<uint64_t>& starts) {
  const LeafHeader& first = ranks[0][leaf];
  TORCH_CHECK(!first.sizes.empty(), "gather: tensor ", leaf, " is 0-d; gather 1-d tensors");
  const int64_t ndim = static_cast<int64_t>(first.sizes.size());
  const int64_t dim = pad_dim_ ? c10::maybe_wrap_dim(*pad_dim_, ndim) : 0;
  check_agreement(ranks, leaf, dim);
  int64_t padded = 0, rows = 0;  // the padded size of `dim`, and the output's rows
  for (const auto& rank : ranks) padded = std::max(padded, rank[leaf].sizes[dim]);
  for (const auto& rank : ranks) rows += dim == 0 && pad_dim_ ? padded : rank[leaf].sizes[0];
  std::vector<int64_t> shape = first.sizes;
  shape[0] = rows;
  if (dim > 0) shape[dim] = padded;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(first.dtype));
  const int64_t elem = static_cast<int64_t>(out.element_size());
  const int64_t inner = product(shape, dim + 1, shape.size()) * elem;
  int64_t row = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const std::vector<int64_t>& sizes = ranks[r][leaf].sizes;
    const int64_t block_rows = dim == 0 && pad_dim_ ? padded : sizes[0];
    at::Tensor block = out.narrow(0, row, block_rows);
    const int64_t missing = (dim == 0 ? block_rows : padded) - sizes[dim];
    if (missing > 0) block.narrow(dim, pad_first_ ? 0 : sizes[dim], missing).fill_(pad_value_);
    Placement& p = placements_[r][leaf];
    p.stream_start = starts[r];
    p.bytes = static_cast<uint64_t>(product(sizes, 0, sizes.size()) * elem);
    p.src_row = static_cast<uint64_t>(sizes[dim] * inner);
    p.dst_row = static_cast<uint64_t>(padded * inner);
    p.dst = static_cast<std::byte*>(block.mutable_data_ptr()) + (pad_first_ ? missing * inner : 0);
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

// Splits rank `rank`'s stream bytes [offset, offset + size) into copies to their places in the outputs.
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

// --- the ops --------------------------------------------------------------------------------------------------

void check_cpu(const at::TensorList leaves, const char* op) {
  for (const at::Tensor& leaf : leaves) {
    TORCH_CHECK(leaf.device().is_cpu(), "accel::", op, ": the shared-memory transport moves CPU tensors, got one on ",
                leaf.device());
  }
}

std::vector<at::Tensor> shm_all_gather(int64_t handle, at::TensorList leaves, std::optional<int64_t> pad_dim,
                                       const c10::Scalar& pad_value, bool pad_first) {
  check_cpu(leaves, "shm_all_gather");
  const std::shared_ptr<shm::Group> group = group_for(handle);
  const ByteStream stream = byte_stream(leaves.vec());
  const std::vector<int64_t> headers = encode_headers(stream.leaves);
  TORCH_CHECK(headers.size() * sizeof(int64_t) <= group->max_meta_bytes(), "accel::shm_all_gather: the headers of ",
              leaves.size(), " tensors do not fit in one slot; raise ACCEL_SHM_SLOT_BYTES");
  GatherPlan plan(pad_dim, pad_value, pad_first);
  translating_errors([&] {
    group->exchange(
        headers.data(), headers.size() * sizeof(int64_t), stream.starts.back(),
        [&](std::byte* dst, uint64_t offset, size_t size) { fill_from(stream, dst, offset, size); },
        [&](const std::vector<shm::PeerMeta>& metas) { plan.on_meta(metas); },
        [&](const std::vector<shm::PeerChunk>& chunks) { plan.on_data(chunks); });
  });
  return plan.take_outputs();
}

// Every rank's bytes concatenated, and each rank's length (objects, shapes, broadcasts, barriers).
std::tuple<at::Tensor, at::Tensor> shm_all_gather_bytes(int64_t handle, const at::Tensor& data) {
  check_cpu(data, "shm_all_gather_bytes");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1, "accel::shm_all_gather_bytes: data must be a 1-d "
              "uint8 tensor, got ", data.scalar_type(), data.sizes());
  const std::shared_ptr<shm::Group> group = group_for(handle);
  const ByteStream stream = byte_stream({data});
  at::Tensor output, lengths;
  std::vector<uint64_t> starts;  // where each rank's bytes go in output
  std::vector<Copy> copies;
  translating_errors([&] {
    group->exchange(
        nullptr, 0, stream.starts.back(),
        [&](std::byte* dst, uint64_t offset, size_t size) { fill_from(stream, dst, offset, size); },
        [&](const std::vector<shm::PeerMeta>& metas) {
          lengths = at::empty({static_cast<int64_t>(metas.size())}, data.options().dtype(at::kLong));
          uint64_t total = 0;
          for (const shm::PeerMeta& meta : metas) {
            lengths.mutable_data_ptr<int64_t>()[starts.size()] = static_cast<int64_t>(meta.data_size);
            starts.push_back(total);
            total += meta.data_size;
          }
          output = at::empty({static_cast<int64_t>(total)}, data.options());
        },
        [&](const std::vector<shm::PeerChunk>& chunks) {
          copies.clear();
          auto* base = static_cast<std::byte*>(output.mutable_data_ptr());
          for (const shm::PeerChunk& c : chunks) copies.push_back({c.data, base + starts[c.rank] + c.offset, c.size});
          run_copies(copies);
        });
  });
  return {output, lengths};
}

}  // namespace
}  // namespace accel

// These ops take no tensor (group handles) or must run for an empty list too, so they are registered for
// every backend; the kernels themselves refuse tensors that are not on the CPU.
TORCH_LIBRARY_IMPL(accel, CompositeExplicitAutograd, m) {
  m.impl("shm_group_create", &accel::shm_group_create);
  m.impl("shm_group_attach", &accel::shm_group_attach);
  m.impl("shm_group_unlink", &accel::shm_group_unlink);
  m.impl("shm_group_destroy", &accel::shm_group_destroy);
  m.impl("shm_all_gather", &accel::shm_all_gather);
  m.impl("shm_all_gather_bytes", &accel::shm_all_gather_bytes);
}
