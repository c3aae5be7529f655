// The meta of accel's shared-memory collectives: what one rank says about its call, written by encode_meta and read
// back from every peer by read_metas, which trusts nothing (a meta that cannot be valid is a corrupt peer).
#pragma once

#include "../shm/shm_group.h"
#include "shared_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <array>
#include <climits>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace accel::transport {

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

// The call of `kind`, named `name` (at most 32 bytes are kept), with its padding arguments.
Call make_call(Kind kind, c10::string_view name, std::optional<int64_t> pad_dim = std::nullopt, bool pad_first = false);

// This rank's meta for a call on `leaves`; refuses dtypes and ranks of tensors a gather cannot move.
std::vector<int64_t> encode_meta(const Call& call, const std::vector<at::Tensor>& leaves);

struct LeafHeader {
  at::ScalarType dtype;
  std::vector<int64_t> sizes;
  uint64_t bytes;
};

struct RankMeta {
  Call call;
  std::vector<LeafHeader> leaves;
};

// Every rank's meta, read and checked (throws shm::Error{Corrupt} naming the peer).
std::vector<RankMeta> read_metas(const std::vector<shm::PeerMeta>& metas, int reader);

// Empty when every rank runs the same collective; otherwise what each one called.
std::string call_mismatch(const std::vector<RankMeta>& ranks);

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

}  // namespace accel::transport
