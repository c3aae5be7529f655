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
#include "shared_group.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace accel {
namespace {

using c10d::OpType;
using Milliseconds = std::chrono::milliseconds;

// --- works: complete when returned ----------------------------------------------------------------------------

// A Work whose collective has finished, carrying its outputs the way gloo's works do (DDP's reducer and the comm
// hooks read the future's value: the tensors for all_reduce, the list of lists for a list all_gather).
class FinishedWork final : public c10d::Work {
 public:
  FinishedWork(int rank, OpType type, std::vector<at::Tensor> result, c10::IValue value, c10::TypePtr value_type)
      : c10d::Work(rank, type),
        result_(std::move(result)),
        future_(c10::make_intrusive<c10::ivalue::Future>(std::move(value_type))) {
    future_->markCompleted(std::move(value));
    finish();
  }

  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

c10::intrusive_ptr<c10d::Work> finished(int rank, OpType type, const std::vector<at::Tensor>& tensors) {
  return c10::make_intrusive<FinishedWork>(rank, type, tensors, c10::IValue(tensors),
                                           c10::ListType::create(c10::TensorType::get()));
}

c10::intrusive_ptr<c10d::Work> finished(int rank, OpType type, const std::vector<std::vector<at::Tensor>>& lists) {
  c10::List<c10::List<at::Tensor>> value;
  std::vector<at::Tensor> flat;
  for (const auto& list : lists) {
    value.push_back(c10::List<at::Tensor>(list));
    flat.insert(flat.end(), list.begin(), list.end());
  }
  return c10::make_intrusive<FinishedWork>(rank, type, std::move(flat), c10::IValue(value),
                                           c10::ListType::create(c10::ListType::create(c10::TensorType::get())));
}

// --- calls as the core sees them -------------------------------------------------------------------------------

// ReduceKind numbers the reductions as torch.distributed's ReduceOp does, and the Call carries it as its op.
static_assert(static_cast<int>(ReduceKind::Sum) == c10d::ReduceOp::SUM &&
                  static_cast<int>(ReduceKind::Avg) == c10d::ReduceOp::AVG &&
                  static_cast<int>(ReduceKind::Product) == c10d::ReduceOp::PRODUCT &&
                  static_cast<int>(ReduceKind::Min) == c10d::ReduceOp::MIN &&
                  static_cast<int>(ReduceKind::Max) == c10d::ReduceOp::MAX &&
                  static_cast<int>(ReduceKind::BitAnd) == c10d::ReduceOp::BAND &&
                  static_cast<int>(ReduceKind::BitOr) == c10d::ReduceOp::BOR &&
                  static_cast<int>(ReduceKind::BitXor) == c10d::ReduceOp::BXOR &&
                  static_cast<int>(ReduceKind::PremulSum) == c10d::ReduceOp::PREMUL_SUM,
              "ReduceKind must follow c10d::ReduceOp's numbering");

shm::Call call_of(const at::Tensor& tensor, ReduceKind kind = ReduceKind::Sum, double factor = 1.0) {
  shm::Call call;
  call.op = static_cast<uint32_t>(kind);
  call.dtype = static_cast<int64_t>(tensor.scalar_type());
  call.count = static_cast<uint64_t>(tensor.numel());
  call.element_bytes = tensor.element_size();
  call.factor = factor;
  return call;
}

// torch's name of a dtype (torch.float32 prints as float32), for the dtypes a collective commonly moves.
std::string dtype_name(int64_t code) {
  if (code < 0 || code >= static_cast<int64_t>(at::ScalarType::Undefined)) return "dtype " + std::to_string(code);
  switch (static_cast<at::ScalarType>(code)) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    default: return c10::toString(static_cast<at::ScalarType>(code));
  }
}

// How a mismatch error shows a rank's call (a peer's fields may be anything: they are only printed).
std::string describe(const shm::Call& call) {
  static const char* const kinds[] = {"?", "all_reduce", "all_reduce", "all_reduce (gather phase)", "broadcast",
                                      "all_gather", "reduce_scatter", "barrier"};
  const auto kind = static_cast<shm::CallKind>(call.kind);
  std::ostringstream out;
  out << (call.kind < static_cast<uint32_t>(shm::CallKind::End) ? kinds[call.kind] : "?") << "(";
  out << dtype_name(call.dtype) << "[" << call.count << "]";
  const bool reduces = kind == shm::CallKind::AllReduce || kind == shm::CallKind::ReduceSlices ||
                       kind == shm::CallKind::ReduceScatter;
  if (reduces && call.op < static_cast<uint32_t>(ReduceKind::Count)) {
    out << ", " << reduce_kind_name(static_cast<ReduceKind>(call.op));
    if (static_cast<ReduceKind>(call.op) == ReduceKind::PremulSum) out << " by " << call.factor;
  }
  if (kind == shm::CallKind::Broadcast) out << ", root " << call.root;
  out << ")";
  return out.str();
}

// The reduction kernels behind the core's Reduce: every part combined in rank order.
shm::Reduce reducer(at::ScalarType dtype, ReduceKind kind, double factor, int world) {
  return [=](const std::byte* const* parts, std::byte* out, uint64_t count) {
    reduce_in_order(reinterpret_cast<const void* const*>(parts), world, out, static_cast<int64_t>(count), dtype, kind,
                    factor);
  };
}

// --- the backend ---------------------------------------------------------------------------------------------------

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

class SharedMemoryBackend final : public c10d::Backend {
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

  // ProcessGroup::hasBackendForDeviceType is torch 2.12+; getDeviceTypes answers the same on every supported torch.
  static bool has_cpu_backend(const c10d::ProcessGroup& group) {
    const auto devices = group.getDeviceTypes();
    return std::any_of(devices.begin(), devices.end(), [](const c10::Device& d) { return d.type() == c10::kCPU; });
  }

  // Once every rank has attached: closes this rank's descriptor and becomes `group`'s backend for CPU tensors, with
  // the backend it had there (gloo) as the delegate for everything not done here.
  void install(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    TORCH_CHECK(!delegate_, "accel process group: install() was already called");
    TORCH_CHECK(has_cpu_backend(*group),
                "accel process group: the process group has no CPU backend to delegate to");
    TORCH_CHECK(group->getSize() == getSize() && group->getRank() == getRank(), "accel process group: rank ",
                getRank(), " of ", getSize(), " cannot serve rank ", group->getRank(), " of ", group->getSize());
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      translating([&] { shared_->group.finish_setup(); });
    }
    delegate_ = group->getBackend(c10::DeviceType::CPU);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM,
                      c10::intrusive_ptr<c10d::Backend>::reclaim_copy(this));
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  }

  // Rounds of the shared-memory protocol so far (tests: which collectives went through shared memory).
  int64_t rounds() {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    return static_cast<int64_t>(group().rounds());
  }

  // --- c10d::Backend ---

  const std::string getBackendName() const override { return "accel"; }

  c10::intrusive_ptr<Options> getBackendOptions() override { return c10::make_intrusive<Options>("accel", timeout_); }

  void setTimeout(Milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    translating([&] { group().set_timeout(timeout); });
    timeout_ = timeout;
    delegate().setTimeout(timeout);
  }

  // Collectives finish when called, so a coalesced block needs no queue: its collectives have run by its end.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override {}
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    return finished(getRank(), OpType::COALESCED, std::vector<at::Tensor>{});
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const std::optional<ReduceKind> kind = reduction(tensors, opts.reduceOp);
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

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    for (const at::Tensor& tensor : tensors) {
      if (!reduction({tensor}, opts.reduceOp)) return delegate().allreduce_coalesced(tensors, opts);
    }
    for (const at::Tensor& tensor : tensors) {
      std::vector<at::Tensor> one{tensor};
      allreduce(one, opts);
    }
    return finished(getRank(), OpType::ALLREDUCE_COALESCED, tensors);
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
    check_gather_outputs(outputs[0], inputs[0]);
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

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    const std::optional<ReduceKind> kind = reduction({input}, opts.reduceOp);
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

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "accel process group: ", outputs.size(), " outputs for ",
                inputs.size(), " inputs");
    for (const at::Tensor& input : inputs) {
      if (!reduction({input}, opts.reduceOp)) return delegate().reduce_scatter_tensor_coalesced(outputs, inputs, opts);
    }
    for (size_t i = 0; i < inputs.size(); ++i) _reduce_scatter_base(outputs[i], inputs[i], opts);
    return finished(getRank(), OpType::COALESCED, outputs);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    on_group(opts.timeout, [&] { collectives_.barrier(); });
    return finished(getRank(), OpType::BARRIER, std::vector<at::Tensor>{});
  }

  // --- delegated to gloo: what training does not need on a fast path ---

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

  // A rank that leaves (destroy_process_group, abort) tells its peers at once: one still waiting for it fails now
  // rather than at its deadline; one that already has what it waited for is not disturbed.
  void shutdown() override { group().abort("its process group was shut down"); }
  void abort() override { group().abort("its process group was aborted"); }

 private:
  SharedMemoryBackend(std::shared_ptr<SharedGroup> shared, int64_t handle, int64_t one_shot_max_bytes)
      : c10d::Backend(shared->group.rank(), shared->group.world()),
        shared_(std::move(shared)),
        handle_(handle),
        collectives_(shared_->group, describe),
        timeout_(shared_->group.timeout()),
        one_shot_max_bytes_(static_cast<uint64_t>(std::max<int64_t>(one_shot_max_bytes, 0))) {}

  shm::Group& group() { return shared_->group; }

  c10d::Backend& delegate() {
    TORCH_CHECK(delegate_, "accel process group: used before install()");
    return *delegate_;
  }

  // Runs body under the group's lock (the core is used by one thread at a time: concurrent calls queue) and the
  // call's timeout, with the core's errors translated.
  template <typename Body>
  void on_group(Milliseconds requested_timeout, const Body& body) {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    CallTimeout timeout(group(), timeout_, requested_timeout);
    translating(body);
  }

  static std::byte* bytes(const at::Tensor& tensor) { return static_cast<std::byte*>(tensor.data_ptr()); }

  // Dense CPU tensors with a fixed element size: what the exchanges move.
  static bool movable(const at::Tensor& tensor) {
    return tensor.device().is_cpu() && tensor.layout() == at::kStrided && !tensor.is_quantized() &&
           !tensor.is_nested() && tensor.element_size() <= 16;
  }

  // The reduction to run here, or nothing when gloo gets the call. The same answer on every rank: it depends on
  // the dtype and the op, which every rank passes alike.
  static std::optional<ReduceKind> reduction(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) {
    if (tensors.size() != 1 || !movable(tensors[0]) || op.op_ >= c10d::ReduceOp::UNUSED) return std::nullopt;
    const auto kind = static_cast<ReduceKind>(static_cast<int>(op.op_));
    if (!reduce_in_order_supported(tensors[0].scalar_type(), kind)) return std::nullopt;
    return kind;
  }

  static double premul_factor(const c10d::ReduceOp& op) {
    if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return 1.0;
    // NCCLPreMulSumSupplement: torch 2.11's name; later versions keep it as an alias of PreMulSumSupplement.
    const auto* supplement = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK(supplement != nullptr, "accel process group: PREMUL_SUM without its factor");
    if (supplement->tensor_factor.defined()) return supplement->tensor_factor.to(at::kCPU).item<double>();
    return supplement->double_factor;
  }

  static void check_same_dtype(const at::Tensor& output, const at::Tensor& input, const char* what) {
    TORCH_CHECK(output.scalar_type() == input.scalar_type(), "accel process group: ", what, " output is ",
                output.scalar_type(), " but the input is ", input.scalar_type());
    TORCH_CHECK(output.device().is_cpu(), "accel process group: ", what, " output is on ", output.device());
  }

  void check_gather_outputs(const std::vector<at::Tensor>& outputs, const at::Tensor& input) const {
    TORCH_CHECK(outputs.size() == static_cast<size_t>(getSize()), "accel process group: all_gather needs ",
                getSize(), " output tensors, got ", outputs.size());
    for (const at::Tensor& out : outputs) {
      check_same_dtype(out, input, "all_gather");
      TORCH_CHECK(out.numel() == input.numel(), "accel process group: all_gather outputs must have the input's ",
                  input.numel(), " elements, got ", out.numel());
    }
  }

  // The exchanges read and write a collective's tensors as gloo's and NCCL's do, as memory, unseen by autograd: a
  // c10d collective is not differentiable (torch's functional collectives are), so a Parameter, a view of one or a
  // tensor of a graph takes part as it is, and its version stays as it was. Non-contiguous tensors go through a
  // contiguous copy, made and written back below autograd for the same reason (the copy_ of the write-back would
  // otherwise refuse a leaf that requires grad, or record itself in a graph).

  // `tensor` itself when it is contiguous, else a contiguous copy of it.
  static at::Tensor dense(const at::Tensor& tensor) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return tensor.contiguous();
  }

  // Writes the results the exchange left in `results` (each from dense(outputs[i])) into the outputs that are not
  // the same tensor. An output whose elements share memory (an expanded tensor) cannot take one result per element:
  // refused, writing no output, after the exchange (every rank has finished it and the group stays usable).
  static void write_results(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& results,
                            const char* what) {
    for (const at::Tensor& output : outputs) {
      TORCH_CHECK(at::has_internal_overlap(output) != at::MemOverlap::Yes, "accel process group: ", what,
                  " cannot write its result into a tensor whose elements share memory (an expanded tensor, stride 0 ",
                  "in a dimension of size > 1; strides ", output.strides(), "); pass one that owns its elements, ",
                  "e.g. tensor.clone()");
    }
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!results[i].is_same(outputs[i])) outputs[i].copy_(results[i]);
    }
  }

  std::shared_ptr<SharedGroup> shared_;  // the group and its lock, shared with accel's own collectives
  const int64_t handle_;
  shm::Collectives collectives_;
  Milliseconds timeout_;
  const uint64_t one_shot_max_bytes_;
  c10::intrusive_ptr<c10d::Backend> delegate_;
};

}  // namespace
}  // namespace accel

namespace accel {

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
    return 0;
  } catch (py::error_already_set& error) {
    error.restore();
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_ImportError, error.what());
  }
  return -1;
}

}  // namespace accel
