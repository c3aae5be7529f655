// accel's torch.distributed backend for CPU tensors on one host: collectives through the shared-memory group of
// csrc/shm/ (the torch-free core: sealed memfd segments, two slots per rank, epoch counters, waits under a deadline
// that notice a dead peer), everything else handed to the gloo backend it wraps.
//
// How it plugs in (accel/wire/shm_process_group.py has the Python side): the ranks of a c10d ProcessGroup
// whose CPU backend is gloo (the default group PartialState starts, or a group created with the backend name
// "accel") decide through the group's store whether they can share memory; if so each creates its segment
// (accel::shm_group_create), they exchange the locators through the store and attach, and each builds a
// SharedMemoryBackend (accel._C.SharedMemoryBackend, a Python subclass of torch's Backend) on the group's handle and
// calls install(), which makes this the ProcessGroup's CPU backend with gloo as its
// delegate. DDP's reducer, FSDP2 and torch.distributed's functions then reach it through the c10d dispatcher with no
// Python in between (measured: ~1.5 us per call on top of the work, against ~10 us for a Python ProcessGroup
// subclass calling a native op).
//
// Every collective here is synchronous: it has finished, on this rank, when the call returns, and its Work is
// complete (a CPU rank has no stream to overlap with, and a background thread would compete with the backward pass
// for the same cores). One collective is one or two Group::exchange calls; each rank's meta says what it runs, and
// every rank checks every meta before any data is touched: an invalid one is a corrupt peer (the group is
// poisoned), valid ones that disagree are rejected by every rank alike, which finish the exchange copying nothing
// and raise the same error ("accel collective mismatch: ..."), leaving the group usable.
//
// The algorithms (one-shot all_reduce up to a size, reduce-scatter + all-gather inside shared memory above it, the
// interleaved reduce_scatter) are torch-free in csrc/shm/collectives.cpp; here they get tensors, and the reductions
// of cpu/vec/reduce_kernels.cpp, which combine every element in rank order 0, 1, ..., world - 1 (fp16/bf16 in
// fp32): the same bits on every rank, whichever path ran.
#include "../python_types.h"
#include "../reduce_in_order.h"
#include "../shm/collectives.h"
#include "../shm/shm_group.h"
#include "backend_support.h"
#include "shared_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace accel {
namespace {

using namespace backend;  // NOLINT(build/namespaces): this file is the backend those helpers serve

class SharedMemoryBackend final : public DelegatingBackend {
 public:
  // The backend of the shared-memory group `handle` (accel::shm_group_create, attached to every peer's segment).
  SharedMemoryBackend(int64_t handle, int64_t one_shot_max_bytes)
      : SharedMemoryBackend(find_group(handle), handle, one_shot_max_bytes) {}

  // The group's handle: accel's own collectives (accel::shm_all_gather, ...) run on the same group, under the same
  // lock.
  int64_t handle() const { return handle_; }

  // The registry's reference goes with the backend (destroy_process_group, or the process group's end): the group
  // is unmapped once no call holds it.
  ~SharedMemoryBackend() override { release_group(handle_); }

  // Once every rank has attached: closes this rank's descriptor and becomes `group`'s backend for CPU tensors, with
  // the backend it had there (gloo) as the delegate for everything not done here.
  void install(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      translating([&] { shared_->group.finish_setup(); });
    }
    become_cpu_backend_of(group);
  }

  // Rounds of the shared-memory protocol so far (tests: which collectives went through shared memory).
  int64_t rounds() {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    return static_cast<int64_t>(group().rounds());
  }

  // --- c10d::Backend ---

  c10::intrusive_ptr<Options> getBackendOptions() override { return c10::make_intrusive<Options>("accel", timeout_); }

  void setTimeout(Milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    translating([&] { group().set_timeout(timeout); });
    timeout_ = timeout;
    delegate().setTimeout(timeout);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const std::optional<ReduceKind> kind = reduction_here(tensors, opts.reduceOp);
    if (!kind) return delegate().allreduce(tensors, opts);
    const double factor = premul_factor(opts.reduceOp);
    const at::Tensor data = dense(tensors[0]);
    on_group(opts.timeout, [&] {
      collectives_.all_reduce(bytes(data), call_of(data, *kind, factor),
                              reducer(data.scalar_type(), *kind, factor, getSize()), one_shot_max_bytes_);
    });
    write_results({tensors[0]}, {data}, "all_reduce");
    return finished(getRank(), OpType::ALLREDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    if (tensors.size() != 1 || !movable(tensors[0]) || opts.rootTensor != 0) {
      return delegate().broadcast(tensors, opts);
    }
    TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < getSize(), "accel process group: broadcast from rank ",
                opts.rootRank, " in a group of ", getSize());
    const at::Tensor data = dense(tensors[0]);
    on_group(opts.timeout, [&] {
      shm::Call call = call_of(data);
      call.root = opts.rootRank;
      collectives_.broadcast(bytes(data), call);
    });
    if (getRank() != opts.rootRank) write_results({tensors[0]}, {data}, "broadcast");  // the root's is only read
    return finished(getRank(), OpType::BROADCAST, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    if (inputs.size() != 1 || outputs.size() != 1 || !movable(inputs[0])) {
      return delegate().allgather(outputs, inputs, opts);
    }
    check_gather_outputs(outputs[0], inputs[0], getSize());
    std::vector<at::Tensor> gathered;
    for (const at::Tensor& out : outputs[0]) gathered.push_back(dense(out));
    const at::Tensor input = dense(inputs[0]);
    on_group(opts.timeout, [&] {
      collectives_.all_gather(bytes(input), [&](int rank) { return bytes(gathered[rank]); }, call_of(input));
    });
    write_results(outputs[0], gathered, "all_gather");
    return finished(getRank(), OpType::ALLGATHER, outputs);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    if (!movable(input)) return delegate()._allgather_base(output, input, opts);
    check_same_dtype(output, input, "all_gather_into_tensor");
    TORCH_CHECK(output.numel() == input.numel() * getSize(), "accel process group: all_gather_into_tensor needs an "
                "output of world_size (", getSize(), ") * ", input.numel(), " elements, got ", output.numel());
    const at::Tensor dense_input = dense(input);
    const at::Tensor gathered = dense(output);
    on_group(opts.timeout, [&] {
      std::byte* base = bytes(gathered);
      const uint64_t stride = dense_input.nbytes();
      collectives_.all_gather(bytes(dense_input), [&](int rank) { return base + rank * stride; },
                              call_of(dense_input));
    });
    write_results({output}, {gathered}, "all_gather_into_tensor");
    return finished(getRank(), OpType::_ALLGATHER_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    const std::optional<ReduceKind> kind = reduction_here({input}, opts.reduceOp);
    if (!kind) return delegate()._reduce_scatter_base(output, input, opts);
    check_same_dtype(output, input, "reduce_scatter_tensor");
    TORCH_CHECK(input.numel() == output.numel() * getSize(), "accel process group: reduce_scatter_tensor needs an "
                "input of world_size (", getSize(), ") * ", output.numel(), " elements, got ", input.numel());
    const double factor = premul_factor(opts.reduceOp);
    const at::Tensor dense_input = dense(input);
    const at::Tensor scattered = dense(output);
    on_group(opts.timeout, [&] {
      collectives_.reduce_scatter(bytes(dense_input), bytes(scattered), call_of(scattered, *kind, factor),
                                  reducer(scattered.scalar_type(), *kind, factor, getSize()));
    });
    write_results({output}, {scattered}, "reduce_scatter_tensor");
    return finished(getRank(), OpType::_REDUCE_SCATTER_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    on_group(opts.timeout, [&] { collectives_.barrier(); });
    return finished(getRank(), OpType::BARRIER, std::vector<at::Tensor>{});
  }


  // A rank that leaves (destroy_process_group, abort) tells its peers at once: one still waiting for it fails now
  // rather than at its deadline; one that already has what it waited for is not disturbed.
  void shutdown() override { group().abort("its process group was shut down"); }
  void abort() override { group().abort("its process group was aborted"); }

 private:
  SharedMemoryBackend(std::shared_ptr<SharedGroup> shared, int64_t handle, int64_t one_shot_max_bytes)
      : DelegatingBackend(shared->group.rank(), shared->group.world()),
        shared_(std::move(shared)),
        handle_(handle),
        collectives_(shared_->group, describe),
        timeout_(shared_->group.timeout()),
        one_shot_max_bytes_(static_cast<uint64_t>(std::max<int64_t>(one_shot_max_bytes, 0))) {}

  shm::Group& group() { return shared_->group; }

  // Runs body under the group's lock (the core is used by one thread at a time: concurrent calls queue) and the
  // call's timeout, with the core's errors translated.
  template <typename Body>
  void on_group(Milliseconds requested_timeout, const Body& body) {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    CallTimeout timeout(group(), timeout_, requested_timeout);
    translating(body);
  }

  std::shared_ptr<SharedGroup> shared_;  // the group and its lock, shared with accel's own collectives
  const int64_t handle_;
  shm::Collectives collectives_;
  Milliseconds timeout_;
  const uint64_t one_shot_max_bytes_;
};

}  // namespace
}  // namespace accel

namespace accel {

void add_host_leader_backend(pybind11::handle module);  // host_leader_backend.cpp: the backend of a group across hosts
void add_direct_collectives(pybind11::handle module);    // shm_transport.cpp: the collectives' kernels without torch.ops

// Python constructs the backend and sets it up through this class (accel._C.SharedMemoryBackend), a subclass of
// torch.distributed's Backend: a ProcessGroup's `_get_backend(cpu)` then returns it as such, with `options` (its
// timeout) like gloo's.
int add_python_types(PyObject* module) {
  namespace py = pybind11;
  try {
    py::module_::import("torch.distributed");  // registers c10d's Python types (Backend, ProcessGroup) first
    py::class_<SharedMemoryBackend, c10d::Backend, c10::intrusive_ptr<SharedMemoryBackend>>(
        module, "SharedMemoryBackend",
        "accel's shared-memory backend for CPU tensors (accel.wire.shm_process_group sets it up).")
        .def(py::init<int64_t, int64_t>(), py::arg("handle"), py::arg("one_shot_max_bytes"))
        .def("handle", &SharedMemoryBackend::handle)
        .def("install", &SharedMemoryBackend::install, py::arg("group"))
        .def("rounds", &SharedMemoryBackend::rounds)
        .def_property_readonly("options", &SharedMemoryBackend::getBackendOptions);
    add_host_leader_backend(module);
    add_direct_collectives(module);
    return 0;
  } catch (py::error_already_set& error) {
    error.restore();
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_ImportError, error.what());
  }
  return -1;
}

}  // namespace accel
