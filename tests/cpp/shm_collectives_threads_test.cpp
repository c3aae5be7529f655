// The collectives of csrc/shm/collectives.h with ranks as threads (so TSan checks them too): randomized sequences
// of all_reduce (both paths), reduce_scatter, broadcast, all_gather and barrier, every result checked on every
// rank, with an order-sensitive reduction so that a rank combining the parts out of rank order shows; ranks that
// call different collectives (all throw CallMismatch, the group stays usable); a peer that publishes a corrupt call
// header; a rank whose reduction throws mid-call (its peers fail fast naming it); bad calls refused up front.
#include "collectives.h"
#include "thread_ranks.h"

#include <random>

namespace {

using namespace shm_test;
using accel::shm::Call;
using accel::shm::CallMismatch;
using accel::shm::Collectives;

// Rank r's element i of call c: a hash, so a byte from the wrong rank, call or offset shows.
uint64_t value(int rank, uint64_t call, uint64_t index) {
  uint64_t x = (static_cast<uint64_t>(rank) + 1) * 0x9e3779b97f4a7c15ull ^ (call + 1) * 0xbf58476d1ce4e5b9ull ^ index;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 29);
}

// acc = acc * 31 + next: depends on the order of the parts, unlike a sum.
template <typename T>
T fold(const T* const* parts, int world, uint64_t i) {
  T acc = parts[0][i];
  for (int r = 1; r < world; ++r) acc = static_cast<T>(acc * 31 + parts[r][i]);
  return acc;
}

template <typename T>
accel::shm::Reduce ordered_reduce(int world) {
  return [world](const std::byte* const* parts, std::byte* out, uint64_t count) {
    const auto* const* typed = reinterpret_cast<const T* const*>(parts);
    T* result = reinterpret_cast<T*>(out);
    for (uint64_t i = 0; i < count; ++i) result[i] = fold(typed, world, i);
  };
}

// Every rank's input of one call, as the element type.
template <typename T>
struct Inputs {
  std::vector<std::vector<T>> by_rank;
  Inputs(int world, uint64_t call, uint64_t count) : by_rank(world, std::vector<T>(count)) {
    for (int r = 0; r < world; ++r) {
      for (uint64_t i = 0; i < count; ++i) by_rank[r][i] = static_cast<T>(value(r, call, i));
    }
  }
  T reduced(uint64_t i) const {
    std::vector<const T*> parts;
    for (const auto& data : by_rank) parts.push_back(data.data());
    return fold(parts.data(), static_cast<int>(by_rank.size()), i);
  }
};

struct Step {
  int kind;  // 0 all_reduce, 1 reduce_scatter, 2 broadcast, 3 all_gather, 4 barrier
  uint64_t count;
  int root;
  uint64_t one_shot_max_bytes;
};

// The same sequence on every rank: made from the workload's seed alone.
std::vector<Step> make_steps(uint64_t seed, int count, int world, size_t slot_bytes) {
  std::mt19937_64 rng(seed);
  std::vector<Step> steps;
  const uint64_t sizes[] = {0, 1, 2, 3, 7, 64, slot_bytes / 8, slot_bytes / 2 + 5, 3 * slot_bytes + 11};
  for (int i = 0; i < count; ++i) {
    const uint64_t thresholds[] = {0, slot_bytes / 4, ~uint64_t{0}};
    steps.push_back({static_cast<int>(rng() % 5), sizes[rng() % 9], static_cast<int>(rng() % world),
                     thresholds[rng() % 3]});
  }
  return steps;
}

template <typename T>
Call call_of(uint64_t count, int root = 0) {
  Call call;
  call.count = count;
  call.element_bytes = sizeof(T);
  call.dtype = sizeof(T);
  call.root = root;
  return call;
}

template <typename T>
void run_step(Collectives& collectives, const Step& step, uint64_t id) {
  const int rank = collectives.group().rank(), world = collectives.group().world();
  const Inputs<T> inputs(world, id, step.kind == 1 ? step.count * world : step.count);
  const std::vector<T>& mine = inputs.by_rank[rank];
  auto bytes = [](auto& vector) { return reinterpret_cast<std::byte*>(vector.data()); };
  switch (step.kind) {
    case 0: {
      std::vector<T> data = mine;
      collectives.all_reduce(bytes(data), call_of<T>(step.count), ordered_reduce<T>(world), step.one_shot_max_bytes);
      for (uint64_t i = 0; i < step.count; ++i) CHECK_MSG(data[i] == inputs.reduced(i), "all_reduce " << id << "[" << i << "]");
      break;
    }
    case 1: {
      std::vector<T> input = mine, output(step.count);
      collectives.reduce_scatter(reinterpret_cast<const std::byte*>(input.data()), bytes(output),
                                 call_of<T>(step.count), ordered_reduce<T>(world));
      for (uint64_t i = 0; i < step.count; ++i) {
        CHECK_MSG(output[i] == inputs.reduced(rank * step.count + i), "reduce_scatter " << id << "[" << i << "]");
      }
      break;
    }
    case 2: {
      std::vector<T> data = mine;
      collectives.broadcast(bytes(data), call_of<T>(step.count, step.root));
      CHECK_MSG(data == inputs.by_rank[step.root], "broadcast " << id);
      break;
    }
    case 3: {
      std::vector<T> output(world * step.count);
      collectives.all_gather(reinterpret_cast<const std::byte*>(mine.data()),
                             [&](int r) { return bytes(output) + r * step.count * sizeof(T); }, call_of<T>(step.count));
      for (int r = 0; r < world; ++r) {
        CHECK_MSG(std::equal(inputs.by_rank[r].begin(), inputs.by_rank[r].end(), output.begin() + r * step.count),
                  "all_gather " << id << " from rank " << r);
      }
      break;
    }
    default:
      collectives.barrier();
  }
}

void run_workload(int world, size_t slot_bytes, int calls, uint64_t seed) {
  const std::string token = random_token();
  {
    Groups groups = make_thread_groups(world, token, slot_bytes);
    const std::vector<Step> steps = make_steps(seed, calls, world, slot_bytes);
    run_ranks(world, [&](int rank) {
      Collectives collectives(*groups[rank]);
      for (size_t i = 0; i < steps.size(); ++i) {
        switch (i % 4) {  // every element size through every collective
          case 0: run_step<uint8_t>(collectives, steps[i], i); break;
          case 1: run_step<uint16_t>(collectives, steps[i], i); break;
          case 2: run_step<uint32_t>(collectives, steps[i], i); break;
          default: run_step<uint64_t>(collectives, steps[i], i);
        }
      }
    });
  }
  CHECK_NO_SHM_LEFT(token);
}

void different_calls_all_throw_and_the_group_stays_usable() {
  const std::string token = random_token();
  Groups groups = make_thread_groups(3, token, 4096);
  std::vector<std::string> messages(3);
  run_ranks(3, [&](int rank) {
    Collectives collectives(*groups[rank]);
    std::vector<uint32_t> data(rank == 2 ? 11 : 10, 1);
    try {
      collectives.all_reduce(reinterpret_cast<std::byte*>(data.data()), call_of<uint32_t>(data.size()),
                             ordered_reduce<uint32_t>(3), 1 << 20);
    } catch (const CallMismatch& error) {
      messages[rank] = error.what();
    }
    std::vector<uint32_t> after(5, static_cast<uint32_t>(rank));
    collectives.broadcast(reinterpret_cast<std::byte*>(after.data()), call_of<uint32_t>(5, 1));
    CHECK(after == std::vector<uint32_t>(5, 1));
  });
  for (const std::string& message : messages) {
    CHECK_MSG(contains(message, "rank 0 all_reduce(10 elements") && contains(message, "rank 2 all_reduce(11 elements"),
              message);
  }
}

// Rank 1 publishes a header through the raw exchange that no Collectives call makes: rank 0 must refuse it.
void a_corrupt_call_header_poisons_the_group() {
  const std::string token = random_token();
  Groups groups = make_thread_groups(2, token, 4096);
  run_ranks(2, [&](int rank) {
    if (rank == 1) {
      Call bad = call_of<uint32_t>(4);
      bad.kind = 99;
      try {
        groups[1]->exchange(&bad, sizeof bad, 16, [](std::byte* dst, uint64_t, size_t size) { std::memset(dst, 0, size); },
                            {}, {});
      } catch (const Error&) {  // rank 0 aborts once it sees the header; either outcome is fine here
      }
      return;
    }
    Collectives collectives(*groups[0]);
    std::vector<uint32_t> data(4, 1);
    const Error error = expect_error(ErrorKind::Corrupt, "corrupt header", [&] {
      collectives.all_reduce(reinterpret_cast<std::byte*>(data.data()), call_of<uint32_t>(4), ordered_reduce<uint32_t>(2),
                             1 << 20);
    });
    CHECK_MSG(error.peer() == 1 && contains(error.what(), "unknown collective 99"), error.what());
    expect_error(ErrorKind::Poisoned, "after the corrupt header", [&] { collectives.barrier(); });
  });
}

// A rank whose reduction throws in the middle of a multi-round all_reduce: it aborts, and the others fail at once
// (well before the 30 s timeout) with an error naming it.
void a_rank_failing_mid_call_fails_the_others_fast() {
  const std::string token = random_token();
  Groups groups = make_thread_groups(3, token, 4096);
  std::vector<int> culprits(3, -2);
  const auto start = std::chrono::steady_clock::now();
  run_ranks(3, [&](int rank) {
    Collectives collectives(*groups[rank]);
    std::vector<uint64_t> data(20000, 1);  // ~40 rounds of 4 KiB
    int rounds = 0;
    auto reduce = [&](const std::byte* const* parts, std::byte* out, uint64_t count) {
      if (rank == 2 && ++rounds == 5) throw std::runtime_error("reduction failed on purpose");
      ordered_reduce<uint64_t>(3)(parts, out, count);
    };
    try {
      collectives.all_reduce(reinterpret_cast<std::byte*>(data.data()), call_of<uint64_t>(data.size()), reduce, 0);
    } catch (const Error& error) {
      culprits[rank] = error.peer();
    } catch (const std::runtime_error&) {
      culprits[rank] = rank;
    }
  });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK_MSG(culprits == std::vector<int>({2, 2, 2}), "culprits " << culprits[0] << culprits[1] << culprits[2]);
  CHECK_MSG(elapsed < std::chrono::seconds(10), "the failure took "
                                                    << std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count()
                                                    << " ms to reach every rank");
}

void bad_calls_are_refused_before_any_exchange() {
  const std::string token = random_token();
  Groups groups = make_thread_groups(1, token, 4096);
  Collectives collectives(*groups[0]);
  std::vector<std::byte> data(24);
  Call odd = call_of<uint8_t>(8);
  odd.element_bytes = 3;
  expect_error(ErrorKind::Usage, "3-byte elements", [&] { collectives.broadcast(data.data(), odd); });
  expect_error(ErrorKind::Usage, "root 1 of 1", [&] { collectives.broadcast(data.data(), call_of<uint8_t>(8, 1)); });
  collectives.barrier();  // nothing was exchanged: the group is fine
  Groups odd_slots = make_thread_groups(1, random_token(), 5000);
  expect_error(ErrorKind::Usage, "5000-byte slots", [&] { Collectives refused(*odd_slots[0]); });
}

}  // namespace

int main() {
  return run_cases({
      {"world 1", [] { run_workload(1, 4096, 200, 21); }},
      {"world 2, 4 KiB slots", [] { run_workload(2, 4096, 400, 22); }},
      {"world 3, 4 KiB slots", [] { run_workload(3, 4096, 300, 23); }},
      {"world 4, 8 KiB slots", [] { run_workload(4, 8192, 200, 24); }},
      {"world 5, 4 KiB slots", [] { run_workload(5, 4096, 100, 25); }},
      {"different calls", different_calls_all_throw_and_the_group_stays_usable},
      {"corrupt call header", a_corrupt_call_header_poisons_the_group},
      {"a rank failing mid-call", a_rank_failing_mid_call_fails_the_others_fast},
      {"bad calls", bad_calls_are_refused_before_any_exchange},
  });
}
