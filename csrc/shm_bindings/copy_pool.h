// Copies of accel's shared-memory collectives: plans of (src, dst, bytes), run on one thread or, for large rounds,
// on torch's intra-op threads.
#pragma once

#include <cstddef>
#include <vector>

namespace accel::transport {

struct Copy {
  const std::byte* src;
  std::byte* dst;
  size_t bytes;
};

void run_copies(const std::vector<Copy>& copies);

}  // namespace accel::transport
