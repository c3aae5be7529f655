// The one exception type of the shared-memory transport. Torch-free: the binding maps it to a Python error.
#pragma once

#include <stdexcept>
#include <string>

namespace accel::shm {

enum class ErrorKind {
  Timeout,      // a peer did not reach the collective before the deadline
  PeerDied,     // a peer process exited (or was killed) while others waited for it
  PeerAborted,  // a peer gave up (its own error, or one it saw) and said why
  Poisoned,     // this group failed earlier and can no longer be used
  Setup,        // creating, sizing or mapping a segment failed, or a peer's segment does not match
  Usage,        // invalid arguments (bad token, rank, sizes), or a group used in a forked child
  Corrupt,      // a peer published a header that cannot be valid (sizes out of bounds); names the peer
};

// what() is a complete sentence a user can act on. peer() is the rank the error is about: the one that
// died or timed out, the culprit named by an abort, the peer whose segment is wrong; -1 when none.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, int peer, const std::string& message)
      : std::runtime_error(message), kind_(kind), peer_(peer) {}

  ErrorKind kind() const noexcept { return kind_; }
  int peer() const noexcept { return peer_; }

 private:
  ErrorKind kind_;
  int peer_;
};

}  // namespace accel::shm
