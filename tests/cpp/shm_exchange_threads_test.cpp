// Test 1: ranks as threads, thousands of randomized exchanges (sizes from empty to several slots, metas up
// to the maximum, random short delays), every byte of every peer checked on every rank. Runs under TSan,
// which checks the slot hand-off: writes of round e+2 against reads of round e.
#include "exchange_check.h"
#include "thread_ranks.h"

namespace {

using namespace shm_test;

void run_workload(int world, size_t slot_bytes, int exchanges, uint64_t seed) {
  const std::string token = random_token();
  {
    Groups groups = make_thread_groups(world, token, slot_bytes);
    CHECK_MSG(dev_shm_entries(token).empty(), "in /dev/shm: " << joined(dev_shm_entries(token)));
    const Workload workload{seed, exchanges, /*delays=*/true};
    std::vector<uint64_t> rounds(world);
    run_ranks(world, [&](int rank) { rounds[rank] = ExchangeChecker(*groups[rank], workload).run_all(); });
    for (int rank = 1; rank < world; ++rank) {
      CHECK_MSG(rounds[rank] == rounds[0],
                "rank " << rank << " ran " << rounds[rank] << " rounds, rank 0 " << rounds[0]);
    }
    CHECK_MSG(rounds[0] > static_cast<uint64_t>(exchanges), "no exchange needed a second round");
  }
  CHECK_NO_SHM_LEFT(token);
}

}  // namespace

int main() {
  return run_cases({
      {"world 1, 4 KiB slots", [] { run_workload(1, 4096, 2000, 11); }},
      {"world 2, 4 KiB slots", [] { run_workload(2, 4096, 2000, 12); }},
      {"world 3, 4 KiB slots", [] { run_workload(3, 4096, 1500, 13); }},
      {"world 4, 4 KiB slots", [] { run_workload(4, 4096, 1000, 14); }},
      {"world 8, 4 KiB slots", [] { run_workload(8, 4096, 400, 15); }},
      {"world 4, odd 5000-byte slots", [] { run_workload(4, 5000, 500, 16); }},
      {"world 3, 64 KiB slots", [] { run_workload(3, 65536, 300, 17); }},
  });
}
