// Copies of accel's shared-memory collectives (copy_pool.h).
#include "copy_pool.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace accel::transport {
namespace {

// Below ~1 MiB per round, waking the thread pool costs more than the copies; above, pieces of 256 KiB.
constexpr size_t kParallelBytes = 1 << 20;
constexpr size_t kPieceBytes = 256 << 10;

}  // namespace

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

}  // namespace accel::transport
