// What accel's c10d backends share: the one-host backend (shm_process_group.cpp) and the backend of a group that
// spans hosts (host_leader_backend.cpp). Works that are complete when returned, calls as the shared-memory core sees
// them, the reduction kernels behind its Reduce, and how a collective's tensors are checked, read and written.
#pragma once

#include "../reduce_in_order.h"
#include "../shm/collectives.h"
#include "../shm/shm_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace accel::backend {

using c10d::OpType;
using Milliseconds = std::chrono::milliseconds;

// --- works: complete when returned (every collective of accel's backends is synchronous) ---

// A finished Work carrying `tensors` the way gloo's works do (DDP's reducer and the comm hooks read the future's
// value: the tensors for all_reduce, the list of lists for a list all_gather).
c10::intrusive_ptr<c10d::Work> finished(int rank, OpType type, const std::vector<at::Tensor>& tensors);
c10::intrusive_ptr<c10d::Work> finished(int rank, OpType type, const std::vector<std::vector<at::Tensor>>& lists);

// --- calls as the core sees them ---

shm::Call call_of(const at::Tensor& tensor, ReduceKind kind = ReduceKind::Sum, double factor = 1.0);
// How a mismatch error shows a rank's call (a peer's fields may be anything: they are only printed).
std::string describe(const shm::Call& call);
// The reduction kernels behind the core's Reduce: every part combined in rank order.
shm::Reduce reducer(at::ScalarType dtype, ReduceKind kind, double factor, int world);

// The timeout of one call: the option's when the caller set one, else the group's.
class CallTimeout {
 public:
  CallTimeout(shm::Group& group, Milliseconds group_timeout, Milliseconds requested)
      : group_(group), group_timeout_(group_timeout),
        changed_(requested != c10d::kUnsetTimeout && requested != group_timeout) {
    if (changed_) group_.set_timeout(requested);
  }
  ~CallTimeout() {
    if (changed_) group_.set_timeout(group_timeout_);
  }
  CallTimeout(const CallTimeout&) = delete;
  CallTimeout& operator=(const CallTimeout&) = delete;

 private:
  shm::Group& group_;
  const Milliseconds group_timeout_;
  const bool changed_;
};

// --- a collective's tensors ---

inline std::byte* bytes(const at::Tensor& tensor) { return static_cast<std::byte*>(tensor.data_ptr()); }

// Dense CPU tensors with a fixed element size: what the exchanges move.
bool movable(const at::Tensor& tensor);

// The reduction to run in shared memory, or nothing when gloo gets the call. The same answer on every rank: it
// depends on the dtype and the op, which every rank passes alike.
std::optional<ReduceKind> reduction(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op);

// PREMUL_SUM's factor (1 for the other ops).
double premul_factor(const c10d::ReduceOp& op);

void check_same_dtype(const at::Tensor& output, const at::Tensor& input, const char* what);
void check_gather_outputs(const std::vector<at::Tensor>& outputs, const at::Tensor& input, int world);

// The exchanges read and write a collective's tensors as gloo's and NCCL's do, as memory, unseen by autograd: a
// c10d collective is not differentiable (torch's functional collectives are), so a Parameter, a view of one or a
// tensor of a graph takes part as it is, and its version stays as it was. Non-contiguous tensors go through a
// contiguous copy, made and written back below autograd for the same reason (the copy_ of the write-back would
// otherwise refuse a leaf that requires grad, or record itself in a graph).

// `tensor` itself when it is contiguous, else a contiguous copy of it.
at::Tensor dense(const at::Tensor& tensor);

// Writes the results the exchange left in `results` (each from dense(outputs[i])) into the outputs that are not
// the same tensor. An output whose elements share memory (an expanded tensor) cannot take one result per element:
// refused, writing no output, after the exchange (every rank has finished it and the group stays usable).
void write_results(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& results, const char* what);

// --- the backend's frame ---

// A c10d backend named "accel" that runs the collectives it moves through shared memory and hands every other call
// to the backend the process group had for CPU tensors (gloo), its delegate: what accel's two backends share. Their
// collectives are synchronous, so a coalesced block needs no queue (its collectives have run by its end).
class DelegatingBackend : public c10d::Backend {
 public:
  const std::string getBackendName() const override { return "accel"; }

  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override {}
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    return finished(getRank(), OpType::COALESCED, std::vector<at::Tensor>{});
  }

  // The reduction this backend runs itself for `tensors` and `op`, or nothing when the delegate gets the call (the
  // same answer on every rank: it depends on the dtype and the op, which every rank passes alike).
  virtual std::optional<ReduceKind> reduction_here(const std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOp& op) const {
    return reduction(tensors, op);
  }

  // The coalesced forms run their collectives one by one (each is done when it returns), unless one of them is the
  // delegate's: then the delegate gets the whole block.
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    for (const at::Tensor& tensor : tensors) {
      if (!reduction_here({tensor}, opts.reduceOp)) return delegate().allreduce_coalesced(tensors, opts);
    }
    for (const at::Tensor& tensor : tensors) {
      std::vector<at::Tensor> one{tensor};
      allreduce(one, opts);
    }
    return finished(getRank(), OpType::ALLREDUCE_COALESCED, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "accel process group: ", outputs.size(), " outputs for ",
                inputs.size(), " inputs");
    for (const at::Tensor& input : inputs) {
      if (!movable(input)) return delegate().allgather_into_tensor_coalesced(outputs, inputs, opts);
    }
    for (size_t i = 0; i < inputs.size(); ++i) _allgather_base(outputs[i], inputs[i], opts);
    return finished(getRank(), OpType::COALESCED, outputs);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "accel process group: ", outputs.size(), " outputs for ",
                inputs.size(), " inputs");
    for (const at::Tensor& input : inputs) {
      if (!reduction_here({input}, opts.reduceOp)) {
        return delegate().reduce_scatter_tensor_coalesced(outputs, inputs, opts);
      }
    }
    for (size_t i = 0; i < inputs.size(); ++i) _reduce_scatter_base(outputs[i], inputs[i], opts);
    return finished(getRank(), OpType::COALESCED, outputs);
  }

  // --- delegated: what training does not need on a fast path ---

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    return delegate().reduce(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    return delegate().allreduce_sparse(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    return delegate().allgather_coalesced(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    return delegate().gather(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    return delegate().scatter(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    return delegate().reduce_scatter(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    return delegate().alltoall_base(output, input, output_splits, input_splits, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    return delegate().alltoall(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return delegate().send(tensors, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return delegate().recv(tensors, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return delegate().recvAnysource(tensors, tag);
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    delegate().monitoredBarrier(opts, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override { delegate().setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return delegate().getSequenceNumberForGroup(); }

 protected:
  DelegatingBackend(int rank, int size) : c10d::Backend(rank, size) {}

  // Becomes `group`'s backend for CPU tensors, the backend it had there (gloo) its delegate. The caller has finished
  // setting up its shared memory first (every rank has attached).
  void become_cpu_backend_of(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    TORCH_CHECK(!delegate_, "accel process group: install() was already called");
    // ProcessGroup::hasBackendForDeviceType is torch 2.12+; getDeviceTypes answers the same on every supported torch.
    const auto devices = group->getDeviceTypes();
    TORCH_CHECK(std::any_of(devices.begin(), devices.end(), [](const c10::Device& d) { return d.type() == c10::kCPU; }),
                "accel process group: the process group has no CPU backend to delegate to");
    TORCH_CHECK(group->getSize() == getSize() && group->getRank() == getRank(), "accel process group: rank ",
                getRank(), " of ", getSize(), " cannot serve rank ", group->getRank(), " of ", group->getSize());
    delegate_ = group->getBackend(c10::DeviceType::CPU);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM,
                      c10::intrusive_ptr<c10d::Backend>::reclaim_copy(this));
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  }

  c10d::Backend& delegate() {
    TORCH_CHECK(delegate_, "accel process group: used before install()");
    return *delegate_;
  }

 private:
  c10::intrusive_ptr<c10d::Backend> delegate_;
};

}  // namespace accel::backend
