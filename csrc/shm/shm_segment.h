// A shared-memory segment without a name in any file system: a sealed memfd, owner-only (0600), its pages
// reserved up front. Peers open it through the creator's descriptor (/proc/<pid>/fd/<fd>) while the creator
// still holds it; from then on only mappings keep it alive, so the memory goes away with the last process
// that maps it, whichever way that process ends. Nothing can be left behind in /dev/shm, not even by SIGKILL.
#pragma once

#include "shm_error.h"

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace accel::shm {

// True for names of the form accel-<16..64 lowercase hex>-r<1..3 digits>: the only names this transport
// gives its segments (shown in /proc/<pid>/maps as /memfd:<name>) and accepts from a peer.
bool is_segment_name(const std::string& name);

// Where a peer finds a segment: the creator's process and the descriptor it holds (/proc/<pid>/fd/<fd>).
struct Locator {
  int64_t pid = 0;
  int64_t fd = -1;
};

class Segment {
 public:
  // Creates the segment `name` with `bytes` bytes, mapped read-write and not inherited by fork() (a
  // DataLoader worker must not get a writable mapping of it). Throws std::invalid_argument for a bad name
  // and Error{Setup} when the memory is not available or a system call fails.
  static Segment create(const std::string& name, size_t bytes);
  // Maps the segment a peer created, through its locator. Throws Error{Setup} when the peer's process or
  // descriptor is gone, or what it names is not an owner-only, sealed segment `name` of exactly
  // `expected_bytes` bytes of this user.
  static Segment open(const Locator& locator, const std::string& name, size_t expected_bytes);

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // The creator's locator; Error{Usage} once the descriptor is closed, or for an opened segment.
  Locator locator() const;
  // Closes the creator's descriptor: once every peer has opened the segment. Idempotent.
  void close_descriptor() noexcept;

  std::byte* data() const noexcept { return mapping_.get(); }
  size_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }

 private:
  Segment(std::string name, std::shared_ptr<std::byte> mapping, size_t size, int fd) noexcept;

  std::string name_;
  // Shared by every Segment of this process on the same file (see MappingRegistry in the .cpp).
  std::shared_ptr<std::byte> mapping_;
  size_t size_ = 0;
  int fd_ = -1;  // the creator's descriptor until close_descriptor(); -1 for an opened segment
};

}  // namespace accel::shm
