// accel's torch.distributed backend for CPU tensors in a group whose ranks span hosts: the ranks of each host share
// memory (one shared-memory group per host, csrc/shm/), and one leader per host (its lowest rank) talks to the other
// hosts' leaders over gloo. The rest of the group's calls go to the group's own gloo backend, as with the one-host
// backend (shm_process_group.cpp), whose helpers it shares (backend_support.h).
//
// How it plugs in (accel/wire/shm_process_group.py, `_set_up_across_hosts`): when the ranks' facts say the group
// spans hosts and some host holds several of its ranks, each host's ranks create and attach a group of their own,
// the leaders start a gloo group among themselves over the process group's store, and every rank builds a
// HostLeaderBackend (accel._C.HostLeaderBackend) and installs it as the process group's CPU backend.
//
// The collectives, each synchronous like the one-host backend's and done under the host group's lock:
//   all_reduce       reduce inside each host (rank order), all-reduce among the leaders, broadcast inside each host;
//   broadcast        inside the root's host, among the leaders from the root's host, inside every other host;
//   all_gather       gather inside each host, all-gather of the host blocks among the leaders (padded to the
//                    largest host), broadcast inside each host, then the blocks placed in rank order;
//   reduce_scatter   an all-reduce as above, then this rank's slice;
//   barrier          inside each host, among the leaders, inside each host.
// Every rank of a host ends with its leader's bytes, and the leaders' all-reduce gives every leader the same bytes,
// so every rank of the group gets the same result (not the same as the one-host order: hosts are summed by gloo).
// A leader whose inter-host step fails (a peer died, the deadline passed) aborts its host group before raising, so
// the ranks of its host fail at once instead of waiting for it until their own deadline.
#include "../python_types.h"
#include "../reduce_in_order.h"
#include "../shm/collectives.h"
#include "../shm/shm_group.h"
#include "backend_support.h"
#include "shared_group.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace accel {
namespace {

using namespace backend;  // the helpers this backend shares with the one-host backend

// The dtypes gloo reduces among the leaders (its allreduce's types); others go to the group's gloo as a whole.
bool leaders_can_reduce(at::ScalarType dtype, ReduceKind kind) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
      return kind != ReduceKind::BitAnd && kind != ReduceKind::BitOr && kind != ReduceKind::BitXor;
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return kind != ReduceKind::Avg;  // an integer mean would round twice (per host, then overall)
    default:
      return false;
  }
}

// What the leaders run for `kind`: the hosts' partial results combine like the ranks' values, except that a mean and a
// premultiplied sum are sums of the hosts' sums (the factor was applied inside each host, the mean's division comes
// after).
c10d::ReduceOp leaders_op(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::Product: return c10d::ReduceOp::PRODUCT;
    case ReduceKind::Min: return c10d::ReduceOp::MIN;
    case ReduceKind::Max: return c10d::ReduceOp::MAX;
    case ReduceKind::BitAnd: return c10d::ReduceOp::BAND;
    case ReduceKind::BitOr: return c10d::ReduceOp::BOR;
    case ReduceKind::BitXor: return c10d::ReduceOp::BXOR;
    default: return c10d::ReduceOp::SUM;
  }
}

class HostLeaderBackend final : public DelegatingBackend {
 public:
  // `handle`: this host's shared-memory group (its ranks numbered in rank order). `hosts`: every host's ranks of the
  // process group, hosts ordered by their lowest rank. `leaders`: the gloo backend among the hosts' leaders (host i's
  // leader is its rank i), on a leader only.
  HostLeaderBackend(int64_t handle, int64_t rank, int64_t size, std::vector<std::vector<int64_t>> hosts,
                    std::optional<c10::intrusive_ptr<c10d::Backend>> leaders, int64_t one_shot_max_bytes)
      : DelegatingBackend(static_cast<int>(rank), static_cast<int>(size)),
        shared_(find_group(handle)),
        handle_(handle),
        collectives_(shared_->group, describe),
        timeout_(shared_->group.timeout()),
        one_shot_max_bytes_(static_cast<uint64_t>(std::max<int64_t>(one_shot_max_bytes, 0))),
        hosts_(std::move(hosts)),
        leaders_(leaders ? *leaders : c10::intrusive_ptr<c10d::Backend>()) {
    check_layout();
  }

  ~HostLeaderBackend() override { release_group(handle_); }

  // Once every rank has attached: becomes `group`'s backend for CPU tensors, its gloo backend the delegate.
  void install(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      translating([&] { host().finish_setup(); });
    }
    become_cpu_backend_of(group);
  }

  // Rounds of this host's shared-memory group so far (tests: which collectives went through shared memory).
  int64_t rounds() {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    return static_cast<int64_t>(host().rounds());
  }

  std::vector<std::vector<int64_t>> hosts() const { return hosts_; }

  // --- c10d::Backend ---

  c10::intrusive_ptr<Options> getBackendOptions() override { return c10::make_intrusive<Options>("accel", timeout_); }

  void setTimeout(Milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    translating([&] { host().set_timeout(timeout); });
    timeout_ = timeout;
    delegate().setTimeout(timeout);
    if (leaders_) leaders_->setTimeout(timeout);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const std::optional<ReduceKind> kind = reduction_here(tensors, opts.reduceOp);
    if (!kind) return delegate().allreduce(tensors, opts);
    const at::Tensor data = dense(tensors[0]);
    on_group(opts.timeout, [&] { all_reduce(data, *kind, premul_factor(opts.reduceOp), opts.timeout); });
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
    on_group(opts.timeout, [&] { broadcast_from(data, opts.rootRank, opts.timeout); });
    if (getRank() != opts.rootRank) write_results({tensors[0]}, {data}, "broadcast");
    return finished(getRank(), OpType::BROADCAST, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    if (inputs.size() != 1 || outputs.size() != 1 || !movable(inputs[0])) {
      return delegate().allgather(outputs, inputs, opts);
    }
    check_gather_outputs(outputs[0], inputs[0], getSize());
    const at::Tensor input = dense(inputs[0]);
    const at::Tensor gathered = at::empty({getSize() * input.numel()}, input.options());
    on_group(opts.timeout, [&] { all_gather(input, gathered, opts.timeout); });
    const std::vector<at::Tensor> parts = gathered.view({getSize(), -1}).unbind(0);
    std::vector<at::Tensor> shaped;
    for (int rank = 0; rank < getSize(); ++rank) shaped.push_back(parts[rank].view(outputs[0][rank].sizes()));
    write_results(outputs[0], shaped, "all_gather");
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
    on_group(opts.timeout, [&] { all_gather(dense_input, gathered, opts.timeout); });
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
    at::Tensor reduced;
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      reduced = input.contiguous().clone();  // the input is only read, as a reduce_scatter's is
    }
    on_group(opts.timeout, [&] { all_reduce(reduced, *kind, premul_factor(opts.reduceOp), opts.timeout); });
    const at::Tensor slice = reduced.view(-1).narrow(0, getRank() * output.numel(), output.numel());
    write_results({output}, {slice.view(output.sizes())}, "reduce_scatter_tensor");
    return finished(getRank(), OpType::_REDUCE_SCATTER_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    on_group(opts.timeout, [&] {
      in_host([&] { collectives_.barrier(); });
      on_leaders([&] {
        c10d::BarrierOptions leader_opts;
        leader_opts.timeout = opts.timeout;
        leaders_->barrier(leader_opts)->wait();
      });
      in_host([&] { collectives_.barrier(); });
    });
    return finished(getRank(), OpType::BARRIER, std::vector<at::Tensor>{});
  }


  // What the shared memory and the leaders can reduce; the rest goes to the group's gloo as a whole.
  std::optional<ReduceKind> reduction_here(const std::vector<at::Tensor>& tensors,
                                           const c10d::ReduceOp& op) const override {
    const std::optional<ReduceKind> kind = reduction(tensors, op);
    if (!kind || !leaders_can_reduce(tensors[0].scalar_type(), *kind)) return std::nullopt;
    return kind;
  }

  void shutdown() override {
    host().abort("its process group was shut down");
    if (leaders_) leaders_->shutdown();
  }
  void abort() override {
    host().abort("its process group was aborted");
    abort_leaders();
  }

 private:
  shm::Group& host() { return shared_->group; }
  int host_size() { return host().world(); }
  bool is_leader() { return host().rank() == 0; }
  int hosts_count() const { return static_cast<int>(hosts_.size()); }

  // The layout every rank passed must be this rank's: a partition of 0..size-1 in which this rank's host is the
  // shared-memory group it attached, at its rank there, and a leader backend exactly on leaders.
  void check_layout() {
    TORCH_CHECK(hosts_.size() >= 2, "accel process group: a group on one host takes SharedMemoryBackend, not ",
                "HostLeaderBackend (", hosts_.size(), " host given)");
    std::vector<bool> seen(getSize(), false);
    std::optional<size_t> mine;
    for (size_t h = 0; h < hosts_.size(); ++h) {
      TORCH_CHECK(!hosts_[h].empty(), "accel process group: host ", h, " has no ranks");
      for (size_t i = 0; i < hosts_[h].size(); ++i) {
        const int64_t rank = hosts_[h][i];
        TORCH_CHECK(rank >= 0 && rank < getSize() && !seen[rank], "accel process group: the hosts' ranks must "
                    "name every rank of the group once; rank ", rank, " is out of range or repeated");
        seen[rank] = true;
        if (rank == getRank()) {
          TORCH_CHECK(static_cast<int>(i) == host().rank() && static_cast<int>(hosts_[h].size()) == host().world(),
                      "accel process group: rank ", rank, " is rank ", i, " of ", hosts_[h].size(),
                      " on its host, but its shared-memory group says rank ", host().rank(), " of ", host().world());
          mine = h;
        }
      }
    }
    TORCH_CHECK(std::all_of(seen.begin(), seen.end(), [](bool s) { return s; }),
                "accel process group: the hosts' ranks leave out ranks of the group");
    host_index_ = static_cast<int>(*mine);
    TORCH_CHECK(static_cast<bool>(leaders_) == is_leader(), "accel process group: rank ", getRank(),
                is_leader() ? " leads its host but has no leaders' backend" : " has a leaders' backend but does not lead");
    if (leaders_) {
      TORCH_CHECK(leaders_->getRank() == host_index_ && leaders_->getSize() == hosts_count(),
                  "accel process group: the leaders' backend is rank ", leaders_->getRank(), " of ",
                  leaders_->getSize(), ", expected ", host_index_, " of ", hosts_count());
    }
  }

  // Runs one collective under the host group's lock and the call's timeout. When the group fails here (a peer of
  // this host died or timed out), a leader also aborts the leaders' group, so that the other hosts' leaders, which
  // wait for this one, fail then rather than at their deadline where the backend supports it (gloo's abort does
  // nothing in torch 2.13: they fail when this process ends and its connections close). A mismatch leaves both
  // usable.
  template <typename Body>
  void on_group(Milliseconds requested_timeout, const Body& body) {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    CallTimeout timeout(host(), timeout_, requested_timeout);
    try {
      translating(body);
    } catch (const c10::DistBackendError&) {
      abort_leaders();
      throw;
    }
  }

  void abort_leaders() noexcept {
    if (!leaders_) return;
    try {
      leaders_->abort();
    } catch (...) {  // a backend without abort: its peers find out when this process ends
    }
  }

  // A step inside this host (nothing to do on a host of one rank).
  template <typename Body>
  void in_host(const Body& body) {
    if (host_size() > 1) body();
  }

  // A step among the leaders, on a leader. A failure aborts this host's group first, so that its other ranks, which
  // wait for this leader, fail now.
  template <typename Body>
  void on_leaders(const Body& body) {
    if (!leaders_) return;
    try {
      body();
    } catch (const std::exception& error) {
      host().abort(std::string("its host's leader failed in a collective among the hosts: ") + error.what());
      throw;
    }
  }

  void all_reduce(const at::Tensor& data, ReduceKind kind, double factor, Milliseconds timeout) {
    const ReduceKind inside = kind == ReduceKind::Avg ? ReduceKind::Sum : kind;
    in_host([&] {
      collectives_.all_reduce(bytes(data), call_of(data, kind, factor),
                              reducer(data.scalar_type(), inside, factor, host_size()), one_shot_max_bytes_);
    });
    on_leaders([&] {
      std::vector<at::Tensor> one{data};
      c10d::AllreduceOptions leader_opts;
      leader_opts.reduceOp = leaders_op(kind);
      leader_opts.timeout = timeout;
      leaders_->allreduce(one, leader_opts)->wait();
      if (kind == ReduceKind::Avg) {
        const at::AutoDispatchBelowADInplaceOrView below_autograd;
        data.div_(getSize());
      }
    });
    in_host([&] {
      shm::Call call = call_of(data);
      call.root = 0;
      collectives_.broadcast(bytes(data), call);
    });
  }

  void broadcast_from(const at::Tensor& data, int64_t root, Milliseconds timeout) {
    const auto root_host = host_of(root);
    const int64_t root_local =
        std::find(hosts_[root_host].begin(), hosts_[root_host].end(), root) - hosts_[root_host].begin();
    shm::Call call = call_of(data);
    if (root_host == host_index_) {
      call.root = root_local;
      in_host([&] { collectives_.broadcast(bytes(data), call); });
    }
    on_leaders([&] {
      std::vector<at::Tensor> one{data};
      c10d::BroadcastOptions leader_opts;
      leader_opts.rootRank = static_cast<int64_t>(root_host);
      leader_opts.timeout = timeout;
      leaders_->broadcast(one, leader_opts)->wait();
    });
    if (root_host != host_index_) {
      call.root = 0;
      in_host([&] { collectives_.broadcast(bytes(data), call); });
    }
  }

  // `gathered` (size * input.numel() elements, contiguous) receives every rank's input in rank order.
  void all_gather(const at::Tensor& input, const at::Tensor& gathered, Milliseconds timeout) {
    const int64_t block = input.nbytes();
    int64_t widest = 0;
    for (const auto& ranks : hosts_) widest = std::max<int64_t>(widest, static_cast<int64_t>(ranks.size()));
    const auto u8 = input.options().dtype(at::kByte);
    // Host h's ranks' inputs at [h][i]; a host with fewer ranks than the widest leaves the rest of its row unused.
    const at::Tensor all = at::empty({hosts_count(), widest * block}, u8);
    std::byte* mine = bytes(all) + host_index_ * widest * block;
    const shm::Call call = call_of(input);
    if (host_size() > 1) {
      collectives_.all_gather(bytes(input), [&](int local) { return mine + local * block; }, call);
    } else {
      std::memcpy(mine, bytes(input), block);
    }
    on_leaders([&] {
      at::Tensor own_row = all.select(0, host_index_).clone();  // gloo's input must not lie inside its output
      at::Tensor flat = all.view(-1);
      c10d::AllgatherOptions leader_opts;
      leader_opts.timeout = timeout;
      leaders_->_allgather_base(flat, own_row, leader_opts)->wait();
    });
    in_host([&] {
      shm::Call whole = call_of(all);
      whole.root = 0;
      collectives_.broadcast(bytes(all), whole);
    });
    std::byte* out = bytes(gathered);
    for (int h = 0; h < hosts_count(); ++h) {
      for (size_t i = 0; i < hosts_[h].size(); ++i) {
        std::memcpy(out + hosts_[h][i] * block, bytes(all) + (h * widest + static_cast<int64_t>(i)) * block, block);
      }
    }
  }

  size_t host_of(int64_t rank) const {
    for (size_t h = 0; h < hosts_.size(); ++h) {
      if (std::find(hosts_[h].begin(), hosts_[h].end(), rank) != hosts_[h].end()) return h;
    }
    TORCH_CHECK(false, "accel process group: rank ", rank, " is on no host");
  }

  std::shared_ptr<SharedGroup> shared_;  // this host's group and its lock
  const int64_t handle_;
  shm::Collectives collectives_;
  Milliseconds timeout_;
  const uint64_t one_shot_max_bytes_;
  const std::vector<std::vector<int64_t>> hosts_;
  int host_index_ = 0;
  c10::intrusive_ptr<c10d::Backend> leaders_;
};

}  // namespace

// accel._C.HostLeaderBackend, added to the module beside SharedMemoryBackend (shm_process_group.cpp).
void add_host_leader_backend(pybind11::handle module) {
  namespace py = pybind11;
  py::class_<HostLeaderBackend, c10d::Backend, c10::intrusive_ptr<HostLeaderBackend>>(
      module, "HostLeaderBackend",
      "accel's backend for CPU tensors of a group that spans hosts: shared memory inside each host, gloo among the "
      "hosts' leaders (accel.wire.shm_process_group sets it up).")
      .def(py::init<int64_t, int64_t, int64_t, std::vector<std::vector<int64_t>>,
                    std::optional<c10::intrusive_ptr<c10d::Backend>>, int64_t>(),
           py::arg("handle"), py::arg("rank"), py::arg("size"), py::arg("hosts"), py::arg("leaders"),
           py::arg("one_shot_max_bytes"))
      .def("install", &HostLeaderBackend::install, py::arg("group"))
      .def("rounds", &HostLeaderBackend::rounds)
      .def("hosts", &HostLeaderBackend::hosts)
      .def_property_readonly("options", &HostLeaderBackend::getBackendOptions);
}

}  // namespace accel
