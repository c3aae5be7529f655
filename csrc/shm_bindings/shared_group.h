// The one shared-memory group of a process group, as the torch side holds it: the core's Group (csrc/shm/) with the
// lock that serialises its users, in a registry under an integer handle.
//
// One group per process group serves both users: accel's c10d backend (shm_process_group.cpp: what DDP, FSDP2 and
// torch.distributed's functions call) and accel's own collectives (shm_transport.cpp: the pytree gathers, padding
// and object exchanges of accel.wire.shm_transport). Python creates it with the accel::shm_group_* ops, the backend
// is built on its handle, and the transport's ops take the same handle: one segment per rank, one set-up, one lock,
// one error mapping.
#pragma once

#include "../shm/collectives.h"
#include "../shm/shm_error.h"
#include "../shm/shm_group.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <memory>
#include <mutex>

namespace accel {

// Starts the message of every error raised because the ranks' calls disagree (the group stays usable); accel/ops.py
// turns those into DistributedOperationException.
constexpr const char* kMismatch = "accel collective mismatch: ";

struct SharedGroup {
  explicit SharedGroup(const shm::Options& options) : group(options) {}
  std::mutex mutex;  // the core is one-thread-at-a-time: every user takes this first, so concurrent calls queue
  shm::Group group;
};

// A new group (this rank's segment) under a fresh handle.
int64_t register_group(const shm::Options& options);
// The group of `handle`; kept alive by the returned pointer through a concurrent release. Raises naming the handle
// when there is none (released, or created in another process).
std::shared_ptr<SharedGroup> find_group(int64_t handle);
// Drops the registry's reference: the group goes once its last user is done. An unknown handle is ignored.
void release_group(int64_t handle);

// The core's errors as torch users expect them from a collective, the same for every user of the group: a failed
// group (a peer died, timed out, aborted or sent garbage; a segment could not be set up) is DistBackendError, as a
// failed gloo or NCCL collective is; the caller's own invalid arguments a RuntimeError; CallMismatch a RuntimeError
// starting with kMismatch.
template <typename Body>
auto translating(Body body) -> decltype(body()) {
  try {
    return body();
  } catch (const shm::Error& error) {
    TORCH_CHECK(error.kind() != shm::ErrorKind::Usage, error.what());
    C10_THROW_ERROR(DistBackendError, error.what());
  } catch (const shm::CallMismatch& error) {
    TORCH_CHECK(false, kMismatch, error.what());
  }
}

}  // namespace accel
