// The torch side of the shared-memory transport (csrc/shm/ is the torch-free protocol): group handles, and
// the collectives that move CPU tensors through one Group::exchange each.
//
// Every rank's meta says which collective it runs (kind, the caller's name for it, padding arguments) and,
// per tensor, its dtype and shape. Nothing a peer publishes is trusted: each meta is validated on its own
// (sizes, counts, ndim, dtype codes, byte sums with overflow checks) before anything is allocated or copied,
// and one that cannot be valid poisons the group ("corrupt header from rank N"). Valid metas that disagree
// (different collectives, shapes or dtypes) are rejected by every rank alike: all finish the exchange copying
// nothing and raise the same error, which starts with kMismatch (Python raises DistributedOperationException),
// and the group stays usable.
//
// shm_all_gather sends the leaves' unpadded bytes as the exchange's data. Every rank sizes the outputs, fills
// their padding, and copies each peer's bytes straight from the peer's slot into the final output: two copies
// per byte (into the own slot, out of the peers' slots), in parallel when a round carries enough bytes to pay
// for the threads. shm_pad_across_processes exchanges shapes only and pads this rank's tensors locally.
//
// Collectives wait with the GIL released (other Python threads run meanwhile) and hold a per-group lock:
// the core's Group is one-thread-at-a-time, so concurrent calls on one group queue instead of interleaving.
#include <Python.h>  // before any standard header, as Python requires

#include "../pad_into.h"
#include "../shm/shm_group.h"

#include <sys/mman.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <vector>

namespace accel {
namespace {

// Starts the message of every error raised because the ranks' calls disagree; accel/ops.py turns those into
// DistributedOperationException.
constexpr const char* kMismatch = "accel collective mismatch: ";

// --- the GIL and group handles: Python holds an integer, the groups live here -----------------------------------

// Releases the GIL for the scope when this thread holds it (a call from Python), so that a collective waiting
// for its peers does not stop the process's other Python threads (data loading, checkpoint writers).
class GilReleased {
 public:
  GilReleased() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilReleased() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

struct GroupHandle {
  explicit GroupHandle(const shm::Options& options) : group(options) {}
  std::mutex mutex;  // serialises the calls of several threads
  shm::Group group;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<GroupHandle>> groups;
  int64_t next_id = 1;
};

Registry& registry() {
  static auto* instance = new Registry();  // never destroyed: groups may be released after static destructors
  return *instance;
}

std::shared_ptr<GroupHandle> handle_for(int64_t handle) {
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

// Runs body(group) without the GIL, holding the group's lock (taken after the GIL is released: a thread
// waiting for the lock must not hold the GIL the lock's holder needs to return).
template <typename Body>
auto on_group(int64_t handle, Body body) -> decltype(body(std::declval<shm::Group&>())) {
  const std::shared_ptr<GroupHandle> held = handle_for(handle);  // keeps the group alive through a destroy
  GilReleased released;
  std::lock_guard<std::mutex> lock(held->mutex);
  return translating_errors([&] { return body(held->group); });
}

int64_t shm_group_create(int64_t rank, int64_t world, c10::string_view token, int64_t slot_bytes, double timeout_s,
                         bool oversubscribed) {
  TORCH_CHECK(timeout_s > 0, "accel shared-memory transport: timeout must be positive, got ", timeout_s);
  shm::Options options;
  options.rank = static_cast<int>(rank);
  options.world = static_cast<int>(world);
  options.token = std::string(token);
  options.slot_bytes = static_cast<size_t>(slot_bytes);
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  options.oversubscribed = oversubscribed;
  auto handle = translating_errors([&] { return std::make_shared<GroupHandle>(options); });
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.groups.emplace(r.next_id, std::move(handle));
  return r.next_id++;
}

std::vector<int64_t> shm_group_locator(int64_t handle) {
  return on_group(handle, [](shm::Group& group) {
    const shm::Locator where = group.locator();
    return std::vector<int64_t>{where.pid, where.fd};
  });
}

void shm_group_attach(int64_t handle, c10::IntArrayRef locators) {
  on_group(handle, [&](shm::Group& group) {
    TORCH_CHECK(locators.size() == 2 * static_cast<size_t>(group.world()), "accel::shm_group_attach: expected ",
                group.world(), " (pid, fd) pairs, got ", locators.size(), " numbers");
    std::vector<shm::Locator> by_rank;
    for (size_t i = 0; i < locators.size(); i += 2) by_rank.push_back({locators[i], locators[i + 1]});
    group.attach_peers(by_rank);
  });
}

void shm_group_finish_setup(int64_t handle) {
  on_group(handle, [](shm::Group& group) { group.finish_setup(); });
}

void shm_group_destroy(int64_t handle) {
  std::shared_ptr<GroupHandle> removed;  // released after the registry's lock
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto found = r.groups.find(handle);
  if (found == r.groups.end()) return;
  removed = std::move(found->second);
  r.groups.erase(found);
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

// --- fresh outputs -------------------------------------------------------------------------------------------------

// Memory the allocator has just mapped costs a page fault per 4 KiB page at first touch, which on these machines
// is several times the copy itself (a fresh 64 MiB buffer: 37 ms to fill in 4 KiB pages, 28 ms when faulted in
// one call, 16.5 ms in transparent huge pages; 8 MiB: 3.5 / 1.65 / 0.9 ms). So before writing an output, ask for
// huge pages (from 4 MiB) and fault the pages in one call. Memory the allocator reuses is mapped already: then
// both calls only walk the page tables. Either may be unsupported (old kernel, THP off): they are hints.
void prefault(void* data, size_t bytes) {
  constexpr uintptr_t kPage = 4096, kHugePage = 2 << 20;
  constexpr size_t kHugeFrom = 4 << 20;
  const auto start = reinterpret_cast<uintptr_t>(data);
  auto inner = [&](uintptr_t align) {
    const uintptr_t begin = (start + align - 1) & ~(align - 1), end = (start + bytes) & ~(align - 1);
    return std::make_pair(reinterpret_cast<void*>(begin), end > begin ? end - begin : 0);
  };
  if (bytes >= kHugeFrom) {
    const auto [begin, length] = inner(kHugePage);
    if (length > 0) ::madvise(begin, length, MADV_HUGEPAGE);
  }
#ifdef MADV_POPULATE_WRITE
  const auto [begin, length] = inner(kPage);
  if (length > 0) ::madvise(begin, length, MADV_POPULATE_WRITE);
#endif
}

// Outputs are fresh memory on every call, which costs the faults and the kernel's zeroing above, and a user
// typically drops gathered tensors soon (a metric computed, the batch done). So the buffers such tensors free
// are kept, up to ACCEL_SHM_KEEP_BYTES in all (default 128 MiB, 0: none), and handed to the next output of the
// same size class: no faults, no zeroing, lines still in cache (a 2-rank gather of 32 MiB per rank: 29 ms
// instead of 79). Beyond the cap, and in a forked child (which must not take a lock that a thread of its parent
// may have held at the fork), buffers are simply freed.
class OutputPool final : public c10::Allocator {
 public:
  static OutputPool& instance() {
    static auto* pool = new OutputPool();  // never destroyed: tensors may be freed after static destructors
    return *pool;
  }

  c10::DataPtr allocate(size_t bytes) override {
    const size_t size = size_class(bytes);
    void* base = take(size);
    if (base == nullptr) {
      base = c10::alloc_cpu(kHeader + size);
      prefault(static_cast<std::byte*>(base) + kHeader, size);
    }
    *static_cast<size_t*>(base) = size;
    return {static_cast<std::byte*>(base) + kHeader, base, &OutputPool::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

 private:
  static constexpr size_t kHeader = 64;  // the buffer's size class, before the data (which stays 64-byte aligned)

  static size_t kept_limit() {
    const char* setting = std::getenv("ACCEL_SHM_KEEP_BYTES");
    return setting != nullptr && *setting != '\0' ? std::strtoull(setting, nullptr, 10) : size_t{128} << 20;
  }

  static size_t size_class(size_t bytes) { return (std::max<size_t>(bytes, 1) + 4095) & ~size_t{4095}; }

  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = kept_.find(size);
    if (found == kept_.end()) return nullptr;
    void* base = found->second;
    kept_.erase(found);
    kept_bytes_ -= size;
    return base;
  }

  static void release(void* base) {
    OutputPool& pool = instance();
    const size_t size = *static_cast<size_t*>(base);
    if (::getpid() == pool.pid_) {
      std::lock_guard<std::mutex> lock(pool.mutex_);
      if (pool.kept_bytes_ + size <= pool.kept_limit_) {
        pool.kept_.emplace(size, base);
        pool.kept_bytes_ += size;
        return;
      }
    }
    c10::free_cpu(base);
  }

  const pid_t pid_ = ::getpid();
  const size_t kept_limit_ = kept_limit();
  std::mutex mutex_;
  std::unordered_multimap<size_t, void*> kept_;
  size_t kept_bytes_ = 0;
};

// An output of at least kPooledFrom bytes comes from the pool; smaller ones from the CPU allocator (malloc
// reuses those without faults anyway).
at::Tensor fresh_output(at::IntArrayRef shape, const at::TensorOptions& options) {
  constexpr size_t kPooledFrom = 64 << 10;
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  size_t bytes = c10::elementSize(dtype);
  bool overflows = false;
  for (const int64_t size : shape) overflows |= __builtin_mul_overflow(bytes, static_cast<size_t>(size), &bytes);
  if (bytes < kPooledFrom || overflows) return at::empty(shape, options);  // at::empty reports an overflow
  return at::detail::empty_generic(shape, &OutputPool::instance(), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                   std::nullopt);
}

// --- the meta: what one rank says about its call ------------------------------------------------------------------
//
// int64 words: [kind, pad dim (kNoPadDim: none), pad first, name (kNameWords words, NUL-padded), leaf count,
// then per leaf: dtype, ndim, sizes...].

enum class Kind : int64_t { Tensors = 1, Bytes = 2, Shapes = 3 };
constexpr int64_t kNoPadDim = INT64_MIN;
constexpr size_t kNameWords = 4;
constexpr size_t kFixedWords = 3 + kNameWords + 1;
constexpr int64_t kMaxDims = 64;

struct Call {
  Kind kind;
  int64_t pad_dim = kNoPadDim;
  int64_t pad_first = 0;
  std::array<int64_t, kNameWords> name{};

  bool operator==(const Call& other) const {
    return kind == other.kind && pad_dim == other.pad_dim && pad_first == other.pad_first && name == other.name;
  }
  std::string name_text() const {
    char text[sizeof name + 1] = {};
    std::memcpy(text, name.data(), sizeof name);
    for (char& c : text) c = (c == '\0' || (c >= ' ' && c <= '~')) ? c : '?';  // a peer's bytes, shown safely
    return text;
  }
};

Call make_call(Kind kind, c10::string_view name, std::optional<int64_t> pad_dim = std::nullopt, bool pad_first = false) {
  Call call{kind, pad_dim.value_or(kNoPadDim), pad_first ? 1 : 0, {}};
  std::memcpy(call.name.data(), name.data(), std::min(name.size(), sizeof call.name));
  return call;
}

// The dtypes a gather moves: those with a fixed element size and a plain byte representation.
bool gatherable(int64_t code) {
  using T = at::ScalarType;
  switch (static_cast<T>(code)) {
    case T::Byte: case T::Char: case T::Short: case T::Int: case T::Long: case T::Half: case T::Float:
    case T::Double: case T::ComplexHalf: case T::ComplexFloat: case T::ComplexDouble: case T::Bool:
    case T::BFloat16: case T::UInt16: case T::UInt32: case T::UInt64: case T::Float8_e5m2:
    case T::Float8_e4m3fn: case T::Float8_e5m2fnuz: case T::Float8_e4m3fnuz:
      return code >= 0 && code < static_cast<int64_t>(T::NumOptions);
    default:
      return false;
  }
}

std::vector<int64_t> encode_meta(const Call& call, const std::vector<at::Tensor>& leaves) {
  std::vector<int64_t> words{static_cast<int64_t>(call.kind), call.pad_dim, call.pad_first};
  words.insert(words.end(), call.name.begin(), call.name.end());
  words.push_back(static_cast<int64_t>(leaves.size()));
  for (const at::Tensor& leaf : leaves) {
    TORCH_CHECK(gatherable(static_cast<int64_t>(leaf.scalar_type())), "accel shared-memory transport: cannot move ",
                leaf.scalar_type(), " tensors");
    TORCH_CHECK(leaf.dim() <= kMaxDims, "accel shared-memory transport: tensors have at most ", kMaxDims, " dims");
    words.push_back(static_cast<int64_t>(leaf.scalar_type()));
    words.push_back(leaf.dim());
    words.insert(words.end(), leaf.sizes().begin(), leaf.sizes().end());
  }
  return words;
}

struct LeafHeader {
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
  uint64_t bytes;
};

struct RankMeta {
  Call call;
  std::vector<LeafHeader> leaves;
};

// Reads a peer's meta, trusting nothing: every field is checked before it is used, and anything impossible
// is a corrupt header that poisons the group. The words are copied first, so a peer cannot change them
// between the check and the use.
class MetaReader {
 public:
  MetaReader(const shm::PeerMeta& meta, int reader) : meta_(meta), reader_(reader) {}

  RankMeta read() {
    if (meta_.meta_size % sizeof(int64_t) != 0 || meta_.meta_size < kFixedWords * sizeof(int64_t)) {
      corrupt("meta of " + std::to_string(meta_.meta_size) + " bytes");
    }
    words_.resize(meta_.meta_size / sizeof(int64_t));
    std::memcpy(words_.data(), meta_.meta, meta_.meta_size);
    RankMeta result{read_call(), {}};
    const int64_t count = words_[kFixedWords - 1];
    if (count < 0 || static_cast<uint64_t>(count) > (words_.size() - kFixedWords) / 2) {
      corrupt("leaf count " + std::to_string(count));
    }
    at_ = kFixedWords;
    uint64_t total = 0;
    for (int64_t leaf = 0; leaf < count; ++leaf) {
      result.leaves.push_back(read_leaf(leaf));
      if (__builtin_add_overflow(total, result.leaves.back().bytes, &total)) corrupt("byte sizes overflow");
    }
    if (at_ != words_.size()) corrupt(std::to_string(words_.size() - at_) + " words after the last tensor");
    check_data_size(result.call.kind, count, total);
    return result;
  }

 private:
  [[noreturn]] void corrupt(const std::string& what) const {
    throw shm::Error(shm::ErrorKind::Corrupt, meta_.rank,
                     "rank " + std::to_string(reader_) + " read a corrupt header from rank " +
                         std::to_string(meta_.rank) + ": " + what + "; the shared-memory group is unusable");
  }

  Call read_call() const {
    const int64_t kind = words_[0];
    if (kind < static_cast<int64_t>(Kind::Tensors) || kind > static_cast<int64_t>(Kind::Shapes)) {
      corrupt("unknown collective kind " + std::to_string(kind));
    }
    if (words_[2] != 0 && words_[2] != 1) corrupt("pad_first " + std::to_string(words_[2]));
    Call call{static_cast<Kind>(kind), words_[1], words_[2], {}};
    std::copy_n(words_.begin() + 3, kNameWords, call.name.begin());
    return call;
  }

  LeafHeader read_leaf(int64_t leaf) {
    if (at_ + 2 > words_.size()) corrupt("tensor " + std::to_string(leaf) + " is cut off");
    const int64_t dtype = words_[at_], ndim = words_[at_ + 1];
    if (!gatherable(dtype)) corrupt("tensor " + std::to_string(leaf) + " has dtype code " + std::to_string(dtype));
    if (ndim < 0 || ndim > kMaxDims || static_cast<uint64_t>(ndim) > words_.size() - at_ - 2) {
      corrupt("tensor " + std::to_string(leaf) + " has ndim " + std::to_string(ndim));
    }
    LeafHeader header{static_cast<at::ScalarType>(dtype), {words_.begin() + at_ + 2, words_.begin() + at_ + 2 + ndim},
                      c10::elementSize(static_cast<at::ScalarType>(dtype))};
    for (const int64_t size : header.sizes) {
      if (size < 0 || __builtin_mul_overflow(header.bytes, static_cast<uint64_t>(size), &header.bytes)) {
        corrupt("tensor " + std::to_string(leaf) + " has size " + std::to_string(size));
      }
    }
    at_ += 2 + static_cast<size_t>(ndim);
    return header;
  }

  // The data must be exactly the tensors' bytes: every copy out of the peer's slot is planned from them.
  void check_data_size(Kind kind, int64_t count, uint64_t total) const {
    const bool valid = kind == Kind::Tensors ? meta_.data_size == total
                       : kind == Kind::Shapes ? meta_.data_size == 0
                                              : count == 0;
    if (!valid) {
      corrupt("data of " + std::to_string(meta_.data_size) + " bytes for tensors of " + std::to_string(total));
    }
  }

  const shm::PeerMeta& meta_;
  const int reader_;
  std::vector<int64_t> words_;
  size_t at_ = 0;
};

std::vector<RankMeta> read_metas(const std::vector<shm::PeerMeta>& metas, int reader) {
  std::vector<RankMeta> ranks;
  ranks.reserve(metas.size());
  for (const shm::PeerMeta& meta : metas) ranks.push_back(MetaReader(meta, reader).read());
  return ranks;
}

// Empty when every rank runs the same collective; otherwise what each one called.
std::string call_mismatch(const std::vector<RankMeta>& ranks) {
  bool same = true;
  for (const RankMeta& rank : ranks) same = same && rank.call == ranks[0].call;
  if (same) return {};
  std::ostringstream out;
  out << "the processes called different collectives (";
  for (size_t r = 0; r < ranks.size(); ++r) {
    const Call& call = ranks[r].call;
    out << (r ? ", " : "") << "process " << r << ": " << call.name_text();
    if (call.kind != Kind::Bytes) out << " of " << ranks[r].leaves.size() << " tensor(s)";
    if (call.pad_dim != kNoPadDim) out << " padded along dim " << call.pad_dim;
  }
  out << "); every process must make the same collective calls in the same order";
  return out.str();
}

// An error every rank finds alike in the metas (so all raise it together after the exchange, the group
// intact): `mismatch` when the ranks disagree, false for an invalid call made the same way everywhere.
struct Rejection {
  std::string message;
  bool mismatch = true;

  void raise_if_any() const {
    if (message.empty()) return;
    if (mismatch) TORCH_CHECK(false, kMismatch, message);
    TORCH_CHECK(false, message);
  }
};

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

ByteStream byte_stream(at::TensorList leaves) {
  ByteStream stream;
  stream.leaves.reserve(leaves.size());
  stream.starts.reserve(leaves.size() + 1);
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

std::string shapes_of(const std::vector<RankMeta>& ranks, size_t leaf) {
  std::ostringstream out;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const LeafHeader& header = ranks[r].leaves[leaf];
    out << (r ? ", " : "") << "process " << r << ": " << header.dtype << c10::IntArrayRef(header.sizes);
  }
  return out.str();
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

// --- the ops --------------------------------------------------------------------------------------------------

void check_cpu(const at::TensorList leaves, const char* op) {
  for (const at::Tensor& leaf : leaves) {
    TORCH_CHECK(leaf.device().is_cpu(), "accel::", op, ": the shared-memory transport moves CPU tensors, got one on ",
                leaf.device());
  }
}

void check_meta_fits(const std::vector<int64_t>& meta, const shm::Group& group, size_t leaves, const char* op) {
  TORCH_CHECK(meta.size() * sizeof(int64_t) <= group.max_meta_bytes(), "accel::", op, ": the headers of ", leaves,
              " tensors do not fit in one slot; raise ACCEL_SHM_SLOT_BYTES");
}

std::vector<at::Tensor> shm_all_gather(int64_t handle, at::TensorList leaves, std::optional<int64_t> pad_dim,
                                       const c10::Scalar& pad_value, bool pad_first, c10::string_view call) {
  check_cpu(leaves, "shm_all_gather");
  const ByteStream stream = byte_stream(leaves);
  const std::vector<int64_t> meta = encode_meta(make_call(Kind::Tensors, call, pad_dim, pad_first), stream.leaves);
  return on_group(handle, [&](shm::Group& group) {
    check_meta_fits(meta, group, leaves.size(), "shm_all_gather");
    GatherPlan plan(pad_dim, pad_value, pad_first, group.rank());
    group.exchange(
        meta.data(), meta.size() * sizeof(int64_t), stream.starts.back(),
        [&](std::byte* dst, uint64_t offset, size_t size) { fill_from(stream, dst, offset, size); },
        [&](const std::vector<shm::PeerMeta>& metas) { plan.on_meta(metas); },
        [&](const std::vector<shm::PeerChunk>& chunks) { plan.on_data(chunks); });
    return plan.take_outputs();
  });
}

// Every rank's bytes concatenated, and each rank's length (objects, shapes, broadcasts, barriers).
std::tuple<at::Tensor, at::Tensor> shm_all_gather_bytes(int64_t handle, const at::Tensor& data,
                                                        c10::string_view call) {
  check_cpu(data, "shm_all_gather_bytes");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1, "accel::shm_all_gather_bytes: data must be a 1-d "
              "uint8 tensor, got ", data.scalar_type(), data.sizes());
  const ByteStream stream = byte_stream({data});
  const std::vector<int64_t> meta = encode_meta(make_call(Kind::Bytes, call), {});
  return on_group(handle, [&](shm::Group& group) {
    at::Tensor output, lengths;
    std::vector<uint64_t> starts;  // where each rank's bytes go in output
    std::vector<Copy> copies;
    Rejection rejection;
    group.exchange(
        meta.data(), meta.size() * sizeof(int64_t), stream.starts.back(),
        [&](std::byte* dst, uint64_t offset, size_t size) { fill_from(stream, dst, offset, size); },
        [&](const std::vector<shm::PeerMeta>& metas) {
          rejection.message = call_mismatch(read_metas(metas, group.rank()));
          if (!rejection.message.empty()) return;
          lengths = at::empty({static_cast<int64_t>(metas.size())}, data.options().dtype(at::kLong));
          uint64_t total = 0;  // at most 256 ranks of at most 2^50 bytes each (checked by the core): no overflow
          for (const shm::PeerMeta& m : metas) {
            lengths.mutable_data_ptr<int64_t>()[starts.size()] = static_cast<int64_t>(m.data_size);
            starts.push_back(total);
            total += m.data_size;
          }
          output = fresh_output({static_cast<int64_t>(total)}, data.options());
        },
        [&](const std::vector<shm::PeerChunk>& chunks) {
          if (!rejection.message.empty()) return;
          copies.clear();
          auto* base = static_cast<std::byte*>(output.mutable_data_ptr());
          for (const shm::PeerChunk& c : chunks) copies.push_back({c.data, base + starts[c.rank] + c.offset, c.size});
          run_copies(copies);
        });
    rejection.raise_if_any();
    return std::make_tuple(output, lengths);
  });
}

// --- pad_across_processes: shapes exchanged, this rank's tensors padded here ------------------------------------

// For each of this rank's leaves, the size to pad `dim` to (-1: leave it as it is), from every rank's shapes;
// a disagreement (counts, numbers of dims) in `rejection`.
std::vector<int64_t> padded_sizes(const std::vector<RankMeta>& ranks, int self, int64_t dim, Rejection& rejection) {
  rejection.message = call_mismatch(ranks);
  if (!rejection.message.empty()) return {};
  std::vector<size_t> counts;
  for (const RankMeta& rank : ranks) counts.push_back(rank.leaves.size());
  if (std::count(counts.begin(), counts.end(), counts[0]) != static_cast<int64_t>(counts.size())) {
    rejection.message = "pad_across_processes: the processes pass different numbers of tensors (" +
                        c10::str(c10::ArrayRef<size_t>(counts)) + ")";
    return {};
  }
  std::vector<int64_t> targets;
  for (size_t leaf = 0; leaf < counts[0]; ++leaf) {
    bool same_ndim = true;
    for (const RankMeta& rank : ranks) {
      same_ndim = same_ndim && rank.leaves[leaf].sizes.size() == ranks[0].leaves[leaf].sizes.size();
    }
    if (!same_ndim) {  // the shapes are formatted for the message only (every call would pay for it otherwise)
      std::vector<std::string> shapes;
      for (const RankMeta& rank : ranks) shapes.push_back(c10::str(c10::IntArrayRef(rank.leaves[leaf].sizes)));
      rejection.message = "pad_across_processes: ranks hold tensors of different ranks (shapes " +
                          c10::str(c10::ArrayRef<std::string>(shapes)) + ")";
      return {};
    }
    const int64_t ndim = static_cast<int64_t>(ranks[self].leaves[leaf].sizes.size());
    if (dim >= ndim || dim < -ndim) {  // HF leaves tensors without that dim untouched
      targets.push_back(-1);
      continue;
    }
    const int64_t d = dim < 0 ? dim + ndim : dim;
    int64_t largest = 0;
    for (const RankMeta& rank : ranks) largest = std::max(largest, rank.leaves[leaf].sizes[d]);
    targets.push_back(largest == ranks[self].leaves[leaf].sizes[d] ? -1 : largest);
  }
  return targets;
}

// accel::pad_into, the one padding kernel (cpu/pad_into.cpp), through the dispatcher.
at::Tensor padded(const at::Tensor& leaf, int64_t dim, int64_t size, const c10::Scalar& pad_value, bool pad_first) {
  static const auto pad_into =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("accel::pad_into", "")
          .typed<void(const at::Tensor&, int64_t, const c10::Scalar&, bool, const at::Tensor&)>();
  std::vector<int64_t> shape = leaf.sizes().vec();
  shape[c10::maybe_wrap_dim(dim, leaf.dim())] = size;
  at::Tensor out = fresh_output(shape, leaf.options().memory_format(at::MemoryFormat::Contiguous));
  pad_into.call(leaf, dim, pad_value, pad_first, out);
  return out;
}

// Returns the padded versions of the leaves that needed padding, and their indices in `leaves`.
std::tuple<std::vector<at::Tensor>, std::vector<int64_t>> shm_pad_across_processes(
    int64_t handle, at::TensorList leaves, int64_t dim, const c10::Scalar& pad_value, bool pad_first) {
  check_cpu(leaves, "shm_pad_across_processes");
  const std::vector<at::Tensor> own = leaves.vec();
  const std::vector<int64_t> meta = encode_meta(make_call(Kind::Shapes, "pad_across_processes"), own);
  std::vector<int64_t> targets;
  on_group(handle, [&](shm::Group& group) {
    check_meta_fits(meta, group, leaves.size(), "shm_pad_across_processes");
    Rejection rejection;
    group.exchange(meta.data(), meta.size() * sizeof(int64_t), 0, {},
                   [&](const std::vector<shm::PeerMeta>& metas) {
                     targets = padded_sizes(read_metas(metas, group.rank()), group.rank(), dim, rejection);
                   },
                   {});
    rejection.raise_if_any();
  });
  std::vector<at::Tensor> outputs;
  std::vector<int64_t> indices;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] < 0) continue;
    outputs.push_back(padded(own[i], dim, targets[i], pad_value, pad_first));
    indices.push_back(static_cast<int64_t>(i));
  }
  return {outputs, indices};
}

}  // namespace
}  // namespace accel

// These ops take no tensor (group handles) or must run for an empty list too, so they are registered for
// every backend; the kernels themselves refuse tensors that are not on the CPU.
TORCH_LIBRARY_IMPL(accel, CompositeExplicitAutograd, m) {
  m.impl("shm_group_create", &accel::shm_group_create);
  m.impl("shm_group_locator", &accel::shm_group_locator);
  m.impl("shm_group_attach", &accel::shm_group_attach);
  m.impl("shm_group_finish_setup", &accel::shm_group_finish_setup);
  m.impl("shm_group_destroy", &accel::shm_group_destroy);
  m.impl("shm_all_gather", &accel::shm_all_gather);
  m.impl("shm_all_gather_bytes", &accel::shm_all_gather_bytes);
  m.impl("shm_pad_across_processes", &accel::shm_pad_across_processes);
}
