// accel::stream_copy_: the staging copy of an asynchronous sharded save (accel/checkpoint/shard_stager.py).
//
// The copy is written once, now, and read once, later, by the checkpoint worker that writes it to disk. A plain
// store first reads each destination line into the cache (read-for-ownership) and then evicts a line the training
// loop needed: a third of the memory traffic is that read. Non-temporal stores write whole lines straight to
// memory, so a copy of tens of MiB moves 2 bytes per byte instead of 3 (~1.3x faster on this project's 2-core VM,
// benchmarks/bench_stream_copy.py). Small tensors, which fit the cache anyway, are copied with memcpy. Bytes are
// moved unchanged: the result equals torch._foreach_copy_ (the reference) bit for bit.
#include "../dense_values.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define ACCEL_HAS_STREAM_STORES 1
#endif

namespace accel {
namespace {

// Tensors below this size are copied with memcpy: they stay in the cache and the line fences would cost more.
constexpr int64_t kStreamMinBytes = 256 << 10;
// The unit of work handed to torch's intra-op threads (a tensor larger than this is split).
constexpr int64_t kChunkBytes = 1 << 20;

struct Chunk {
  uint8_t* dst;
  const uint8_t* src;
  int64_t bytes;
  bool stream;
};

#ifdef ACCEL_HAS_STREAM_STORES
// Copies with 16-byte non-temporal stores, four to a 64-byte line so that each line is written whole.
void stream_bytes(uint8_t* dst, const uint8_t* src, int64_t bytes) {
  const int64_t head = std::min<int64_t>(bytes, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, bytes - i);
}
#endif

void copy_chunk(const Chunk& chunk) {
#ifdef ACCEL_HAS_STREAM_STORES
  if (chunk.stream) {
    stream_bytes(chunk.dst, chunk.src, chunk.bytes);
    return;
  }
#endif
  std::memcpy(chunk.dst, chunk.src, chunk.bytes);
}

void check_pair(const at::Tensor& target, const at::Tensor& source, size_t i) {
  TORCH_CHECK(target.device().is_cpu() && source.device().is_cpu(), "accel::stream_copy_: targets[", i,
              "] and sources[", i, "] must be CPU tensors, got ", target.device(), " and ", source.device());
  TORCH_CHECK(target.scalar_type() == source.scalar_type(), "accel::stream_copy_: targets[", i, "] is ",
              target.scalar_type(), " but sources[", i, "] is ", source.scalar_type());
  TORCH_CHECK(target.sizes() == source.sizes(), "accel::stream_copy_: targets[", i, "] has shape ", target.sizes(),
              " but sources[", i, "] has shape ", source.sizes());
  const at::MemOverlapStatus overlap = at::get_overlap_status(target, source);
  TORCH_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
              "accel::stream_copy_: targets[", i, "] and sources[", i, "] share memory");
}

// Every contiguous pair cut into chunks of at most kChunkBytes, in order; a pair with a strided side, or a conjugate
// or negative view (see dense_values.h), is copied by torch's copy_ here instead (what the reference does for it). Every pair is checked before any is copied, so a bad
// pair leaves every target as it was.
std::vector<Chunk> plan_chunks(at::TensorList targets, at::TensorList sources) {
  for (size_t i = 0; i < targets.size(); ++i) check_pair(targets[i], sources[i], i);
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (!targets[i].is_contiguous() || !sources[i].is_contiguous() || !holds_values(targets[i]) ||
        !holds_values(sources[i])) {
      at::Tensor target = targets[i];
      target.copy_(sources[i]);
      continue;
    }
    const int64_t bytes = static_cast<int64_t>(targets[i].nbytes());
    auto* dst = static_cast<uint8_t*>(targets[i].mutable_data_ptr());
    const auto* src = static_cast<const uint8_t*>(sources[i].const_data_ptr());
    const bool stream = bytes >= kStreamMinBytes;
    for (int64_t offset = 0; offset < bytes; offset += kChunkBytes) {
      chunks.push_back({dst + offset, src + offset, std::min(kChunkBytes, bytes - offset), stream});
    }
  }
  return chunks;
}

void stream_copy_cpu(at::TensorList targets, at::TensorList sources) {
  TORCH_CHECK(targets.size() == sources.size(), "accel::stream_copy_: ", targets.size(), " targets but ",
              sources.size(), " sources");
  const std::vector<Chunk> chunks = plan_chunks(targets, sources);
  int64_t total = 0;
  for (const Chunk& chunk : chunks) total += chunk.bytes;
  // Under ~1 MiB in all, waking other threads costs more than the copy: one thread does it all.
  const int64_t grain = total < kChunkBytes ? static_cast<int64_t>(chunks.size()) + 1 : 1;
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) copy_chunk(chunks[c]);
#ifdef ACCEL_HAS_STREAM_STORES
    // Non-temporal stores are weakly ordered: fence them in the thread that made them, before the copy is
    // reported done and another thread (the checkpoint worker) reads the target.
    _mm_sfence();
#endif
  });
}

}  // namespace
}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CPU, m) { m.impl("stream_copy_", &accel::stream_copy_cpu); }
