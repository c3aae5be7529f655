// CPU kernel of accel::pad_into: memcpy for the data, a typed pattern store for the padding.
#include "../dense_values.h"
#include "../pad_into.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

namespace accel {
namespace {

// Writes the out elements [begin, end) (flat indices): each row is [pad | data | pad] in elements.
void pad_range(const uint8_t* src, uint8_t* out, const PadGeometry& g, const PadPattern& pattern,
               int64_t begin, int64_t end) {
  const int64_t es = g.elem_size;
  const int64_t data_begin = g.offset, data_end = g.offset + g.src_row;
  for (int64_t e = begin; e < end;) {
    const int64_t row = e / g.out_row, col = e % g.out_row;
    const int64_t stop = std::min(g.out_row, col + (end - e));  // column where this row's segment ends
    uint8_t* row_out = out + row * g.out_row * es;
    const int64_t lo = std::max(col, data_begin), hi = std::min(stop, data_end);
    if (lo < hi) {
      std::memcpy(row_out + lo * es, src + (row * g.src_row + lo - data_begin) * es, (hi - lo) * es);
      fill_elements(row_out + col * es, std::max<int64_t>(0, std::min(stop, data_begin) - col), es, pattern);
      fill_elements(row_out + hi * es, std::max<int64_t>(0, stop - hi), es, pattern);
    } else {
      fill_elements(row_out + col * es, stop - col, es, pattern);
    }
    e += stop - col;
  }
}

void pad_into_cpu(const at::Tensor& src, int64_t dim, const c10::Scalar& pad_value, bool pad_first,
                  const at::Tensor& out) {
  dim = checked_pad_dim(src, dim, out);
  const at::Tensor src_c = dense_values(src);
  const PadGeometry g = pad_geometry(src_c, dim, pad_first, out);
  const PadPattern pattern = pad_pattern(pad_value, src.scalar_type());
  const auto* src_bytes = static_cast<const uint8_t*>(src_c.const_data_ptr());
  auto* out_bytes = static_cast<uint8_t*>(out.mutable_data_ptr());
  // Under ~256 KiB a thread pool hand-off costs more than the copy itself.
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / g.elem_size);
  at::parallel_for(0, g.rows * g.out_row, grain, [&](int64_t begin, int64_t end) {
    pad_range(src_bytes, out_bytes, g, pattern, begin, end);
  });
}

}  // namespace
}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CPU, m) { m.impl("pad_into", &accel::pad_into_cpu); }
