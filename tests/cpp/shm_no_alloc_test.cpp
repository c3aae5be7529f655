// Steady-state exchanges allocate nothing: the core reuses its vectors, waits read /proc into a stack
// buffer, and callbacks are passed by reference. Global operator new is replaced to count allocations
// while the measured exchanges run. Ranks are threads; runs under every sanitizer.
#include "thread_ranks.h"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {

std::atomic<bool> counting{false};
std::atomic<long> allocations{0};

}  // namespace

// noinline: inlined into a caller, GCC pairs the new-expression with free() and warns of a mismatch.
[[gnu::noinline]] void* operator new(size_t size) {
  if (counting.load(std::memory_order_relaxed)) allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace {

using namespace shm_test;
using accel::shm::Group;

// Data of 2.5 slots, so every exchange runs three rounds; the callbacks are built once, outside the loop.
void steady_state_does_not_allocate(int world) {
  const std::string token = random_token();
  const size_t slot = 4096;
  Groups groups = make_thread_groups(world, token, slot);
  std::vector<std::byte> sink(slot);
  run_ranks(world, [&](int rank) {
    Group& group = *groups[rank];
    const uint64_t meta = rank;
    const accel::shm::Fill fill = [](std::byte* dst, uint64_t, size_t size) { std::memset(dst, 1, size); };
    const accel::shm::OnMeta on_meta = [](const std::vector<accel::shm::PeerMeta>&) {};
    const accel::shm::OnData on_data = [&](const std::vector<accel::shm::PeerChunk>& chunks) {
      if (rank == 0) std::memcpy(sink.data(), chunks.back().data, std::min(slot, chunks.back().size));
    };
    auto run = [&](int exchanges) {
      for (int i = 0; i < exchanges; ++i) group.exchange(&meta, sizeof meta, slot * 5 / 2, fill, on_meta, on_data);
    };
    run(20);  // warm-up; it needs every rank, so all threads exist before anyone starts counting
    counting = true;
    run(500);
  });
  counting = false;
  CHECK_MSG(allocations.load() == 0, allocations.load() << " allocations in steady-state exchanges");
  groups.clear();
  CHECK_NO_SHM_LEFT(token);
}

}  // namespace

int main() {
  return run_cases({
      {"world 1: steady-state exchanges do not allocate", [] { steady_state_does_not_allocate(1); }},
      {"world 3: steady-state exchanges do not allocate", [] { steady_state_does_not_allocate(3); }},
  });
}
