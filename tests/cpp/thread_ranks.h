// Ranks as threads of one process, set up the way callers set them up across processes: every rank
// creates its segment, then every rank attaches through every rank's locator, then every rank finishes.
#pragma once

#include "test_util.h"

#include <memory>
#include <thread>

namespace shm_test {

using Groups = std::vector<std::unique_ptr<accel::shm::Group>>;

inline Groups make_thread_groups(int world, const std::string& token, size_t slot_bytes,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  Groups groups;
  for (int rank = 0; rank < world; ++rank) {
    groups.push_back(std::make_unique<accel::shm::Group>(options_for(token, rank, world, slot_bytes, timeout)));
  }
  std::vector<accel::shm::Locator> locators;
  for (auto& group : groups) locators.push_back(group->locator());
  for (auto& group : groups) group->attach_peers(locators);
  for (auto& group : groups) group->finish_setup();
  return groups;
}

// Runs body(rank) on one thread per rank and CHECKs that none of them threw; a failure names the rank.
template <class Body>
void run_ranks(int world, Body body) {
  std::vector<std::string> failures(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (const std::exception& error) {
        failures[rank] = error.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int rank = 0; rank < world; ++rank) {
    CHECK_MSG(failures[rank].empty(), "rank " << rank << ": " << failures[rank]);
  }
}

}  // namespace shm_test
