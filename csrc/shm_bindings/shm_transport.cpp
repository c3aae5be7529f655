// The ops of accel's own collectives on a process group's shared-memory group (shared_group.h; csrc/shm/ is the
// torch-free protocol): creating a group, and the collectives that move CPU tensors through one Group::exchange
// each. What they are built from lives beside this file: call_meta.* (what each rank says about its call, read back
// trusting nothing), gather_plan.* (this rank's bytes out, every rank's bytes into the outputs), output_pool.* (the
// outputs' memory), copy_pool.* (the copies, parallel for large rounds).
//
// Every rank's meta says which collective it runs (kind, the caller's name for it, padding arguments) and,
// per tensor, its dtype and shape. Nothing a peer publishes is trusted: each meta is validated on its own
// (sizes, counts, ndim, dtype codes, byte sums with overflow checks) before anything is allocated or copied,
// and one that cannot be valid poisons the group ("corrupt header from rank N"). Valid metas that disagree
// (different collectives, shapes or dtypes) are rejected by every rank alike: all finish the exchange copying
// nothing and raise the same error, which starts with kMismatch (Python raises DistributedOperationException),
// and the group stays usable.
//
// shm_all_gather sends the leaves' unpadded bytes as the exchange's data. Every rank sizes the outputs, fills
// their padding, and copies each peer's bytes straight from the peer's slot into the final output: two copies
// per byte (into the own slot, out of the peers' slots), in parallel when a round carries enough bytes to pay
// for the threads. shm_pad_across_processes exchanges shapes only and pads this rank's tensors locally.
//
// Collectives wait with the GIL released (other Python threads run meanwhile) and hold the group's lock, which
// the c10d backend's collectives take too: the core's Group is one-thread-at-a-time, so concurrent calls on one
// group queue instead of interleaving.
#include <Python.h>  // before any standard header, as Python requires

#include "../pad_into.h"
#include "../shm/shm_group.h"
#include "call_meta.h"
#include "gather_plan.h"
#include "output_pool.h"
#include "shared_group.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace accel {
namespace {

using namespace transport;

// --- the GIL and group handles: Python holds an integer, the groups live here -----------------------------------

// Releases the GIL for the scope when this thread holds it (a call from Python), so that a collective waiting
// for its peers does not stop the process's other Python threads (data loading, checkpoint writers).
class GilReleased {
 public:
  GilReleased() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilReleased() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

// Runs body(group) without the GIL, holding the group's lock (taken after the GIL is released: a thread
// waiting for the lock must not hold the GIL the lock's holder needs to return).
template <typename Body>
auto on_group(int64_t handle, Body body) -> decltype(body(std::declval<shm::Group&>())) {
  const std::shared_ptr<SharedGroup> held = find_group(handle);  // keeps the group alive through a release
  GilReleased released;
  std::lock_guard<std::mutex> lock(held->mutex);
  return translating([&] { return body(held->group); });
}

int64_t shm_group_create(int64_t rank, int64_t world, c10::string_view token, int64_t slot_bytes, double timeout_s,
                         bool oversubscribed) {
  TORCH_CHECK(timeout_s > 0, "accel shared-memory group: timeout must be positive, got ", timeout_s);
  shm::Options options;
  options.rank = static_cast<int>(rank);
  options.world = static_cast<int>(world);
  options.token = std::string(token);
  options.slot_bytes = static_cast<size_t>(slot_bytes);
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  options.oversubscribed = oversubscribed;
  return register_group(options);
}

std::vector<int64_t> shm_group_locator(int64_t handle) {
  return on_group(handle, [](shm::Group& group) {
    const shm::Locator where = group.locator();
    return std::vector<int64_t>{where.pid, where.fd};
  });
}

void shm_group_attach(int64_t handle, c10::IntArrayRef locators) {
  on_group(handle, [&](shm::Group& group) {
    TORCH_CHECK(locators.size() == 2 * static_cast<size_t>(group.world()), "accel::shm_group_attach: expected ",
                group.world(), " (pid, fd) pairs, got ", locators.size(), " numbers");
    std::vector<shm::Locator> by_rank;
    for (size_t i = 0; i < locators.size(); i += 2) by_rank.push_back({locators[i], locators[i + 1]});
    group.attach_peers(by_rank);
  });
}

void shm_group_finish_setup(int64_t handle) {
  on_group(handle, [](shm::Group& group) { group.finish_setup(); });
}

void shm_group_destroy(int64_t handle) { release_group(handle); }

// --- the ops --------------------------------------------------------------------------------------------------

void check_cpu(const at::TensorList leaves, const char* op) {
  for (const at::Tensor& leaf : leaves) {
    TORCH_CHECK(leaf.device().is_cpu(), "accel::", op, ": the shared-memory transport moves CPU tensors, got one on ",
                leaf.device());
  }
}

void check_meta_fits(const std::vector<int64_t>& meta, const shm::Group& group, size_t leaves, const char* op) {
  TORCH_CHECK(meta.size() * sizeof(int64_t) <= group.max_meta_bytes(), "accel::", op, ": the headers of ", leaves,
              " tensors do not fit in one slot; raise ACCEL_SHM_SLOT_BYTES");
}

std::vector<at::Tensor> shm_all_gather(int64_t handle, at::TensorList leaves, std::optional<int64_t> pad_dim,
                                       const c10::Scalar& pad_value, bool pad_first, c10::string_view call) {
  check_cpu(leaves, "shm_all_gather");
  const ByteStream stream = byte_stream(leaves);
  const std::vector<int64_t> meta = encode_meta(make_call(Kind::Tensors, call, pad_dim, pad_first), stream.leaves);
  return on_group(handle, [&](shm::Group& group) {
    check_meta_fits(meta, group, leaves.size(), "shm_all_gather");
    GatherPlan plan(pad_dim, pad_value, pad_first, group.rank());
    group.exchange(
        meta.data(), meta.size() * sizeof(int64_t), stream.starts.back(),
        [&](std::byte* dst, uint64_t offset, size_t size) { fill_from(stream, dst, offset, size); },
        [&](const std::vector<shm::PeerMeta>& metas) { plan.on_meta(metas); },
        [&](const std::vector<shm::PeerChunk>& chunks) { plan.on_data(chunks); });
    return plan.take_outputs();
  });
}

// Every rank's bytes concatenated, and each rank's length (objects, shapes, broadcasts, barriers).
std::tuple<at::Tensor, at::Tensor> shm_all_gather_bytes(int64_t handle, const at::Tensor& data,
                                                        c10::string_view call) {
  check_cpu(data, "shm_all_gather_bytes");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 1, "accel::shm_all_gather_bytes: data must be a 1-d "
              "uint8 tensor, got ", data.scalar_type(), data.sizes());
  const ByteStream stream = byte_stream({data});
  const std::vector<int64_t> meta = encode_meta(make_call(Kind::Bytes, call), {});
  return on_group(handle, [&](shm::Group& group) {
    at::Tensor output, lengths;
    std::vector<uint64_t> starts;  // where each rank's bytes go in output
    std::vector<Copy> copies;
    Rejection rejection;
    group.exchange(
        meta.data(), meta.size() * sizeof(int64_t), stream.starts.back(),
        [&](std::byte* dst, uint64_t offset, size_t size) { fill_from(stream, dst, offset, size); },
        [&](const std::vector<shm::PeerMeta>& metas) {
          rejection.message = call_mismatch(read_metas(metas, group.rank()));
          if (!rejection.message.empty()) return;
          lengths = at::empty({static_cast<int64_t>(metas.size())}, data.options().dtype(at::kLong));
          uint64_t total = 0;  // at most 256 ranks of at most 2^50 bytes each (checked by the core): no overflow
          for (const shm::PeerMeta& m : metas) {
            lengths.mutable_data_ptr<int64_t>()[starts.size()] = static_cast<int64_t>(m.data_size);
            starts.push_back(total);
            total += m.data_size;
          }
          output = fresh_output({static_cast<int64_t>(total)}, data.options());
        },
        [&](const std::vector<shm::PeerChunk>& chunks) {
          if (!rejection.message.empty()) return;
          copies.clear();
          auto* base = static_cast<std::byte*>(output.mutable_data_ptr());
          for (const shm::PeerChunk& c : chunks) copies.push_back({c.data, base + starts[c.rank] + c.offset, c.size});
          run_copies(copies);
        });
    rejection.raise_if_any();
    return std::make_tuple(output, lengths);
  });
}

// --- pad_across_processes: shapes exchanged, this rank's tensors padded here ------------------------------------

// For each of this rank's leaves, the size to pad `dim` to (-1: leave it as it is), from every rank's shapes;
// a disagreement (counts, numbers of dims) in `rejection`.
std::vector<int64_t> padded_sizes(const std::vector<RankMeta>& ranks, int self, int64_t dim, Rejection& rejection) {
  rejection.message = call_mismatch(ranks);
  if (!rejection.message.empty()) return {};
  std::vector<size_t> counts;
  for (const RankMeta& rank : ranks) counts.push_back(rank.leaves.size());
  if (std::count(counts.begin(), counts.end(), counts[0]) != static_cast<int64_t>(counts.size())) {
    rejection.message = "pad_across_processes: the processes pass different numbers of tensors (" +
                        c10::str(c10::ArrayRef<size_t>(counts)) + ")";
    return {};
  }
  std::vector<int64_t> targets;
  for (size_t leaf = 0; leaf < counts[0]; ++leaf) {
    bool same_ndim = true;
    for (const RankMeta& rank : ranks) {
      same_ndim = same_ndim && rank.leaves[leaf].sizes.size() == ranks[0].leaves[leaf].sizes.size();
    }
    if (!same_ndim) {  // the shapes are formatted for the message only (every call would pay for it otherwise)
      std::vector<std::string> shapes;
      for (const RankMeta& rank : ranks) shapes.push_back(c10::str(c10::IntArrayRef(rank.leaves[leaf].sizes)));
      rejection.message = "pad_across_processes: ranks hold tensors of different ranks (shapes " +
                          c10::str(c10::ArrayRef<std::string>(shapes)) + ")";
      return {};
    }
    const int64_t ndim = static_cast<int64_t>(ranks[self].leaves[leaf].sizes.size());
    if (dim >= ndim || dim < -ndim) {  // HF leaves tensors without that dim untouched
      targets.push_back(-1);
      continue;
    }
    const int64_t d = dim < 0 ? dim + ndim : dim;
    int64_t largest = 0;
    for (const RankMeta& rank : ranks) largest = std::max(largest, rank.leaves[leaf].sizes[d]);
    targets.push_back(largest == ranks[self].leaves[leaf].sizes[d] ? -1 : largest);
  }
  return targets;
}

// accel::pad_into, the one padding kernel (cpu/pad_into.cpp), through the dispatcher.
at::Tensor padded(const at::Tensor& leaf, int64_t dim, int64_t size, const c10::Scalar& pad_value, bool pad_first) {
  static const auto pad_into =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("accel::pad_into", "")
          .typed<void(const at::Tensor&, int64_t, const c10::Scalar&, bool, const at::Tensor&)>();
  std::vector<int64_t> shape = leaf.sizes().vec();
  shape[c10::maybe_wrap_dim(dim, leaf.dim())] = size;
  at::Tensor out = fresh_output(shape, leaf.options().memory_format(at::MemoryFormat::Contiguous));
  pad_into.call(leaf, dim, pad_value, pad_first, out);
  return out;
}

// Returns the padded versions of the leaves that needed padding, and their indices in `leaves`.
std::tuple<std::vector<at::Tensor>, std::vector<int64_t>> shm_pad_across_processes(
    int64_t handle, at::TensorList leaves, int64_t dim, const c10::Scalar& pad_value, bool pad_first) {
  check_cpu(leaves, "shm_pad_across_processes");
  const std::vector<at::Tensor> own = leaves.vec();
  const std::vector<int64_t> meta = encode_meta(make_call(Kind::Shapes, "pad_across_processes"), own);
  std::vector<int64_t> targets;
  on_group(handle, [&](shm::Group& group) {
    check_meta_fits(meta, group, leaves.size(), "shm_pad_across_processes");
    Rejection rejection;
    group.exchange(meta.data(), meta.size() * sizeof(int64_t), 0, {},
                   [&](const std::vector<shm::PeerMeta>& metas) {
                     targets = padded_sizes(read_metas(metas, group.rank()), group.rank(), dim, rejection);
                   },
                   {});
    rejection.raise_if_any();
  });
  std::vector<at::Tensor> outputs;
  std::vector<int64_t> indices;
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] < 0) continue;
    outputs.push_back(padded(own[i], dim, targets[i], pad_value, pad_first));
    indices.push_back(static_cast<int64_t>(i));
  }
  return {outputs, indices};
}

}  // namespace
}  // namespace accel

// These ops take no tensor (group handles) or must run for an empty list too, so they are registered for
// every backend; the kernels themselves refuse tensors that are not on the CPU.
TORCH_LIBRARY_IMPL(accel, CompositeExplicitAutograd, m) {
  m.impl("shm_group_create", &accel::shm_group_create);
  m.impl("shm_group_locator", &accel::shm_group_locator);
  m.impl("shm_group_attach", &accel::shm_group_attach);
  m.impl("shm_group_finish_setup", &accel::shm_group_finish_setup);
  m.impl("shm_group_destroy", &accel::shm_group_destroy);
  m.impl("shm_all_gather", &accel::shm_all_gather);
  m.impl("shm_all_gather_bytes", &accel::shm_all_gather_bytes);
  m.impl("shm_pad_across_processes", &accel::shm_pad_across_processes);
}

namespace accel {
namespace {

// The fill value of a padding call (torch's caster does not load a Scalar): a Python bool, int or float.
c10::Scalar fill_value(const pybind11::handle& value) {
  if (PyBool_Check(value.ptr())) return c10::Scalar(value.ptr() == Py_True);
  if (PyLong_Check(value.ptr())) return c10::Scalar(value.cast<int64_t>());
  if (PyFloat_Check(value.ptr())) return c10::Scalar(value.cast<double>());
  TORCH_CHECK_TYPE(false, "accel: the padding value must be a bool, int or float, got ", Py_TYPE(value.ptr())->tp_name);
}

}  // namespace

// The same three kernels as plain functions of accel._C, for the eager path of accel's own collectives (accel/ops.py
// calls them when nothing traces: no tensor subclass, no dispatch mode, no torch.compile). A call through torch.ops
// costs about 2 us of boxing before the kernel runs, as much as the whole rendezvous of a small gather on one host;
// these cost a pybind call. torch's wrapper raises c10's errors as torch.ops would (DistBackendError included).
void add_direct_collectives(pybind11::handle module) {
  namespace py = pybind11;
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  m.def("shm_all_gather",
        torch::wrap_pybind_function([](int64_t handle, const std::vector<at::Tensor>& leaves,
                                       std::optional<int64_t> pad_dim, const py::object& pad_value, bool pad_first,
                                       const std::string& call) {
          return shm_all_gather(handle, leaves, pad_dim, fill_value(pad_value), pad_first, call);
        }),
        py::arg("group"), py::arg("leaves"), py::arg("pad_dim"), py::arg("pad_value"), py::arg("pad_first"),
        py::arg("call"));
  m.def("shm_all_gather_bytes",
        torch::wrap_pybind_function([](int64_t handle, const at::Tensor& data, const std::string& call) {
          return shm_all_gather_bytes(handle, data, call);
        }),
        py::arg("group"), py::arg("data"), py::arg("call"));
  m.def("shm_pad_across_processes",
        torch::wrap_pybind_function([](int64_t handle, const std::vector<at::Tensor>& leaves, int64_t dim,
                                       const py::object& pad_value, bool pad_first) {
          return shm_pad_across_processes(handle, leaves, dim, fill_value(pad_value), pad_first);
        }),
        py::arg("group"), py::arg("leaves"), py::arg("dim"), py::arg("pad_value"), py::arg("pad_first"));
}

}  // namespace accel
