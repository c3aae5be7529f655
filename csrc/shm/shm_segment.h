// A POSIX shared-memory segment owned through RAII: created owner-only (0600) with its pages reserved up
// front, or opened by a peer after checking size, owner and mode.
#pragma once

#include "shm_error.h"

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>

namespace accel::shm {

// True for names of the form /accel-<16..64 lowercase hex>-r<1..3 digits>: the only names this transport
// creates or opens, so a bad token can never touch an unrelated segment.
bool is_segment_name(const std::string& name);

class Segment {
 public:
  // Creates `name` (which must not exist) with `bytes` bytes reserved in /dev/shm, mode 0600, mapped
  // read-write. Throws std::invalid_argument for a bad name and Error{Setup} when /dev/shm lacks the space
  // or a system call fails; nothing is left in /dev/shm on failure. The creator unlinks it (unlink(), or
  // the destructor when it never did).
  static Segment create(const std::string& name, size_t bytes);
  // Maps an existing segment read-write. Throws Error{Setup} when it is missing, is not exactly
  // `expected_bytes` long, or is not an owner-only segment of this user.
  static Segment open(const std::string& name, size_t expected_bytes);

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // Removes the name from /dev/shm; existing mappings stay valid. Idempotent. Only the creator may call it.
  void unlink();

  std::byte* data() const noexcept { return mapping_.get(); }
  size_t size() const noexcept { return size_; }
  const std::string& name() const noexcept { return name_; }

 private:
  Segment(std::string name, std::shared_ptr<std::byte> mapping, size_t size, bool creator) noexcept;
  void release() noexcept;

  std::string name_;
  // Shared by every Segment of this process on the same file (see MappingRegistry in the .cpp).
  std::shared_ptr<std::byte> mapping_;
  size_t size_ = 0;
  pid_t creator_pid_ = 0;  // the process that created the segment; 0 when it was opened
  bool linked_ = false;    // the creator has not unlinked the name yet
};

}  // namespace accel::shm
