// The meta of accel's shared-memory collectives (call_meta.h).
#include "call_meta.h"

#include "../shm/shm_error.h"

#include <algorithm>
#include <sstream>

namespace accel::transport {
namespace {

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

}  // namespace

Call make_call(Kind kind, c10::string_view name, std::optional<int64_t> pad_dim, bool pad_first) {
  Call call{kind, pad_dim.value_or(kNoPadDim), pad_first ? 1 : 0, {}};
  std::memcpy(call.name.data(), name.data(), std::min(name.size(), sizeof call.name));
  return call;
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

}  // namespace accel::transport
