// Shared by cpu/pad_into.cpp and cuda/pad_into.cu: argument checks and the geometry of a pad.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/Scalar.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace accel {

// The padded layout seen as `rows` rows of `out_row` elements: each row holds `src_row` elements of src
// starting at `offset`, padding elsewhere. Everything is in elements of `elem_size` bytes.
struct PadGeometry {
  int64_t rows = 0;
  int64_t src_row = 0;
  int64_t out_row = 0;
  int64_t offset = 0;
  int64_t elem_size = 0;
};

// A 16-byte element (complex128) moved as two words: views only guarantee 8-byte alignment.
struct Bytes16 {
  uint64_t lo, hi;
};

// The pad value as the bytes of one element of `dtype`. Converted by torch itself (scalar_tensor), so the
// rounding, bool and overflow rules are exactly those of the reference's new_full.
struct PadPattern {
  alignas(16) uint8_t bytes[16] = {};
};

// Checks everything a user can get wrong and returns dim wrapped into [0, src.dim()).
inline int64_t checked_pad_dim(const at::Tensor& src, int64_t dim, const at::Tensor& out) {
  TORCH_CHECK(src.dim() > 0, "accel::pad_into: src must have at least one dimension, got a 0-d tensor");
  dim = c10::maybe_wrap_dim(dim, src.dim());
  TORCH_CHECK(src.dim() == out.dim(), "accel::pad_into: src has ", src.dim(), " dims but out has ", out.dim());
  TORCH_CHECK(src.scalar_type() == out.scalar_type(), "accel::pad_into: dtype mismatch, src is ",
              src.scalar_type(), " and out is ", out.scalar_type());
  TORCH_CHECK(src.device() == out.device(), "accel::pad_into: src is on ", src.device(), " but out is on ",
              out.device());
  TORCH_CHECK(out.is_contiguous(), "accel::pad_into: out must be contiguous");
  // The kernels copy with memcpy / __restrict__ loads: src and out must not share memory.
  at::assert_no_overlap(out, src);
  for (int64_t d = 0; d < src.dim(); ++d) {
    if (d == dim) {
      TORCH_CHECK(out.size(d) >= src.size(d), "accel::pad_into: out.size(", d, ")=", out.size(d),
                  " is smaller than src.size(", d, ")=", src.size(d));
    } else {
      TORCH_CHECK(out.size(d) == src.size(d), "accel::pad_into: out.size(", d, ")=", out.size(d),
                  " must equal src.size(", d, ")=", src.size(d), " (only dim ", dim, " is padded)");
    }
  }
  return dim;
}

inline PadGeometry pad_geometry(const at::Tensor& src, int64_t dim, bool pad_first, const at::Tensor& out) {
  int64_t inner = 1;
  for (int64_t d = dim + 1; d < src.dim(); ++d) inner *= src.size(d);
  PadGeometry g;
  g.rows = 1;
  for (int64_t d = 0; d < dim; ++d) g.rows *= src.size(d);
  g.src_row = src.size(dim) * inner;
  g.out_row = out.size(dim) * inner;
  g.offset = pad_first ? g.out_row - g.src_row : 0;
  g.elem_size = static_cast<int64_t>(src.element_size());
  return g;
}

inline PadPattern pad_pattern(const c10::Scalar& pad_value, at::ScalarType dtype) {
  const at::Tensor value = at::scalar_tensor(pad_value, at::TensorOptions().dtype(dtype));
  TORCH_INTERNAL_ASSERT(value.element_size() <= 16);
  PadPattern pattern;
  std::memcpy(pattern.bytes, value.const_data_ptr(), value.element_size());
  return pattern;
}

template <typename T>
void fill_pattern(uint8_t* dst, int64_t count, const PadPattern& pattern) {
  T value;
  std::memcpy(&value, pattern.bytes, sizeof(T));
  T* typed = reinterpret_cast<T*>(dst);
  std::fill(typed, typed + count, value);
}

// Host memory: `count` elements of `elem_size` bytes at dst, each set to the pattern (the CPU kernel's padding, and
// the shared-memory gather's, which pads while it places the ranks' data).
inline void fill_elements(uint8_t* dst, int64_t count, int64_t elem_size, const PadPattern& pattern) {
  switch (elem_size) {
    case 1: std::memset(dst, pattern.bytes[0], count); break;
    case 2: fill_pattern<uint16_t>(dst, count, pattern); break;
    case 4: fill_pattern<uint32_t>(dst, count, pattern); break;
    case 8: fill_pattern<uint64_t>(dst, count, pattern); break;
    case 16: fill_pattern<Bytes16>(dst, count, pattern); break;
    default: TORCH_INTERNAL_ASSERT(false, "accel::pad_into: unexpected element size ", elem_size);
  }
}

}  // namespace accel
