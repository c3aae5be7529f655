// For kernels that read a tensor's memory as raw bytes (the shared-memory gather and process group, the pad and the
// ordered reduction, the stream copy, the file writer): that memory holds the tensor's values only when no
// conjugate or negative bit is set. `x.conj()` and `x.conj().imag` are such views: their memory holds the
// unconjugated, unnegated values, and contiguous() returns them as they are. Read through `dense_values`.
#pragma once

#include <ATen/core/Tensor.h>

namespace accel {

// A tensor with `t`'s values in one dense run of memory: `t` itself when it is already one (no copy). The bits are
// tested first: resolve_conj() and resolve_neg() are dispatcher calls, which a small gather would feel.
inline at::Tensor dense_values(const at::Tensor& t) {
  if (t.is_conj() || t.is_neg()) return t.resolve_conj().resolve_neg().contiguous();
  return t.contiguous();
}

// Whether `t`'s memory holds its values (no conjugate or negative view bit): kernels that write into `t` or read it
// in place check this.
inline bool holds_values(const at::Tensor& t) { return !t.is_conj() && !t.is_neg(); }

}  // namespace accel
