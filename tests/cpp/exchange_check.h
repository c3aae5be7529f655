// A randomized exchange workload that every rank runs and checks on its own: sizes, metas and data are a
// deterministic function of (seed, exchange, rank), so each rank knows what every peer must have sent.
#pragma once

#include "test_util.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

namespace shm_test {

struct Workload {
  uint64_t seed = 1;
  int exchanges = 100;
  bool delays = true;  // random short sleeps and yields at random points, to shuffle the interleavings
};

struct Sizes {
  size_t meta;
  uint64_t data;
};

inline uint64_t mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ b * 0xC2B2AE3D27D4EB4Full ^ c * 0x165667B19E3779F9ull ^ d;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

// Sizes that hit the edges: empty, tiny, exactly one slot, just around whole slots (slot - 64 is round 1's
// capacity with a small meta), several slots plus an odd remainder, and anything up to four slots.
inline uint64_t pick_data_size(std::mt19937_64& rng, uint64_t slot) {
  switch (rng() % 8) {
    case 0: return 0;
    case 1: return 1 + rng() % 15;
    case 2: return slot;
    case 3: {
      const int64_t deltas[] = {-64, -63, -1, 0, 1};
      return (1 + rng() % 3) * slot + deltas[rng() % 5];
    }
    case 4: return (2 + rng() % 3) * slot + ((rng() % slot) | 1);
    default: return rng() % (4 * slot);
  }
}

inline size_t pick_meta_size(std::mt19937_64& rng, size_t max_meta) {
  const uint64_t choice = rng() % 10;
  if (choice < 3) return 0;
  if (choice < 8) return 1 + rng() % 100;
  if (choice == 8) return max_meta;
  return rng() % (max_meta / 2);
}

inline Sizes sizes_for(const Workload& workload, int exchange, int rank, const accel::shm::Group& group) {
  std::mt19937_64 rng(mix(workload.seed, exchange, rank, 0));
  const size_t meta = pick_meta_size(rng, group.max_meta_bytes());
  return Sizes{meta, pick_data_size(rng, group.slot_bytes())};
}

inline uint64_t meta_seed(const Workload& w, int exchange, int rank) { return mix(w.seed, exchange, rank, 1); }
inline uint64_t data_seed(const Workload& w, int exchange, int rank) { return mix(w.seed, exchange, rank, 2); }

// One rank's side of the workload: runs the exchanges and checks every peer's meta and every byte of data.
class ExchangeChecker {
 public:
  ExchangeChecker(accel::shm::Group& group, const Workload& workload)
      : group_(group),
        workload_(workload),
        next_offset_(group.world()),
        delay_rng_(mix(workload.seed, group.rank(), 7, 7)) {}

  // Returns the total number of rounds run, which must be the same on every rank.
  uint64_t run_all() {
    for (int exchange = 0; exchange < workload_.exchanges; ++exchange) run_one(exchange);
    return group_.rounds();
  }

  void run_one(int exchange) {
    exchange_ = exchange;
    own_ = sizes_for(workload_, exchange, group_.rank(), group_);
    meta_.resize(own_.meta);
    Pattern::get().write(meta_.data(), meta_seed(workload_, exchange, group_.rank()), 0, own_.meta);
    std::fill(next_offset_.begin(), next_offset_.end(), 0);
    meta_calls_ = data_calls_ = 0;
    const uint64_t rounds_before = group_.rounds();
    maybe_delay();
    group_.exchange(
        meta_.data(), own_.meta, own_.data,
        [&](std::byte* dst, uint64_t offset, size_t size) { fill(dst, offset, size); },
        [&](const std::vector<accel::shm::PeerMeta>& metas) { check_metas(metas); },
        [&](const std::vector<accel::shm::PeerChunk>& chunks) { check_chunks(chunks); });
    check_complete(group_.rounds() - rounds_before);
  }

 private:
  void fill(std::byte* dst, uint64_t offset, size_t size) {
    CHECK_MSG(size > 0 && offset + size <= own_.data, "fill asked for [" << offset << ", +" << size << ")");
    maybe_delay();
    Pattern::get().write(dst, data_seed(workload_, exchange_, group_.rank()), offset, size);
  }

  void check_metas(const std::vector<accel::shm::PeerMeta>& metas) {
    ++meta_calls_;
    CHECK_MSG(data_calls_ == 0, "on_meta must come before any on_data");
    CHECK(metas.size() == static_cast<size_t>(group_.world()));
    for (int rank = 0; rank < group_.world(); ++rank) {
      const accel::shm::PeerMeta& meta = metas[rank];
      const Sizes want = sizes_for(workload_, exchange_, rank, group_);
      CHECK(meta.rank == rank);
      CHECK_MSG(meta.meta_size == want.meta && meta.data_size == want.data,
                "rank " << rank << " exchange " << exchange_ << ": got sizes " << meta.meta_size << "/"
                        << meta.data_size << ", want " << want.meta << "/" << want.data);
      CHECK_MSG(Pattern::get().matches(meta.meta, meta_seed(workload_, exchange_, rank), 0, meta.meta_size),
                "rank " << rank << " exchange " << exchange_ << ": meta bytes differ");
    }
    maybe_delay();
  }

  void check_chunks(const std::vector<accel::shm::PeerChunk>& chunks) {
    CHECK(meta_calls_ == 1);
    ++data_calls_;
    CHECK(!chunks.empty());
    int previous_rank = -1;
    for (const accel::shm::PeerChunk& chunk : chunks) {
      CHECK_MSG(chunk.rank > previous_rank && chunk.rank < group_.world(), "chunks out of rank order");
      previous_rank = chunk.rank;
      CHECK_MSG(chunk.size > 0 && chunk.offset == next_offset_[chunk.rank],
                "rank " << chunk.rank << ": chunk at " << chunk.offset << " (+" << chunk.size
                        << "), expected offset " << next_offset_[chunk.rank]);
      const uint64_t seed = data_seed(workload_, exchange_, chunk.rank);
      CHECK_MSG(Pattern::get().matches(chunk.data, seed, chunk.offset, chunk.size),
                "rank " << chunk.rank << " exchange " << exchange_ << ": data bytes differ in [" << chunk.offset
                        << ", +" << chunk.size << ")");
      next_offset_[chunk.rank] += chunk.size;
    }
    maybe_delay();
  }

  // Every byte arrived; every round but possibly the first (when nobody had data in it) carried data.
  void check_complete(uint64_t rounds) {
    CHECK(meta_calls_ == 1);
    for (int rank = 0; rank < group_.world(); ++rank) {
      const uint64_t want = sizes_for(workload_, exchange_, rank, group_).data;
      CHECK_MSG(next_offset_[rank] == want,
                "rank " << rank << ": got " << next_offset_[rank] << " of " << want << " bytes");
    }
    CHECK_MSG(rounds >= 1 && (rounds == data_calls_ || rounds == data_calls_ + 1),
              rounds << " rounds but " << data_calls_ << " on_data calls");
  }

  void maybe_delay() {
    if (!workload_.delays) return;
    const uint64_t draw = delay_rng_() % 256;
    if (draw == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_rng_() % 300));
    } else if (draw < 4) {
      std::this_thread::yield();
    }
  }

  accel::shm::Group& group_;
  const Workload& workload_;
  std::vector<uint64_t> next_offset_;
  std::vector<std::byte> meta_;
  std::mt19937_64 delay_rng_;
  int exchange_ = 0;
  Sizes own_{0, 0};
  int meta_calls_ = 0;
  uint64_t data_calls_ = 0;
};

}  // namespace shm_test
