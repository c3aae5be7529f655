// Every accel op schema, declared once. Kernels register per backend in cpu/<family>.cpp and
// cuda/<family>.cu; accel/ops.py holds the Python wrapper and fake (meta) kernel of each.
#include <Python.h>
#include <torch/library.h>

#include "python_types.h"

extern "C" {
// Importing accel._C runs the static registrations below; the module itself holds no op, only the process group
// backends' classes (a c10d::Backend has to reach Python as one, see shm_bindings/shm_process_group.cpp) and the
// direct entries of the shared-memory collectives' kernels (shm_bindings/shm_transport.cpp: the eager path).
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && accel::add_python_types(module) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}

TORCH_LIBRARY(accel, m) {
  // Writes src into out along dim (out.size(dim) >= src.size(dim)) and pad_value everywhere else; the
  // padding goes before the data when pad_first. The pack step of the padded all-gather.
  m.def("pad_into(Tensor src, int dim, Scalar pad_value, bool pad_first, Tensor(a!) out) -> ()");

  // The fused gradient unscale (cpu/grad_unscale.cpp, cuda/grad_unscale.cu). Multiplies every grad by inv_scale
  // in fp32, as torch._amp_foreach_non_finite_check_and_unscale_ does (bit for bit), sets found_inf to 1 when a
  // grad holds inf or nan, and writes each grad's sum of squares of the unscaled fp32 values to sq_norms (fp64,
  // one entry per grad), all in one pass; with inv_scale == 1 it only reads. Grads: dense, contiguous, fp32/fp16/bf16.
  m.def("unscale_grads_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, Tensor(c!) sq_norms) -> ()");
  // clip_grad_norm_'s scaling step: grads *= min(1, max_norm / (total_norm + 1e-6)), with total_norm (fp32, one
  // element) read where it lives, so a CUDA caller never waits for it.
  m.def("clip_grads_(Tensor(a!)[] grads, Tensor total_norm, float max_norm) -> ()");

  // The safetensors byte mover (cpu/tensor_file_io.cpp, cuda/tensor_file_io.cu), on the caller's open file `fd`
  // (`path` names it in messages). Writes `header` at the start of the file, then each tensor's bytes at
  // header.numel() + offsets[i], with the size reserved first, then fsyncs. Python plans the header and offsets and
  // removes a file whose write failed (accel/checkpoint/safetensors_io.py). A failed system call is returned in
  // `status` (int64 {errno, tensor index or -1}; {0, -1}: none), for the caller to raise as an OSError.
  m.def("write_tensors_(int fd, str path, Tensor header, Tensor[] tensors, int[] offsets, Tensor(a!) status) -> ()");
  // Reads the bytes at file offsets[i] of `fd` into outs[i] (contiguous), straight into their memory; `status` as
  // above. A file too short for the reads, or changed while read, raises.
  m.def("read_tensors_(int fd, str path, int[] offsets, Tensor(a!)[] outs, Tensor(b!) status) -> ()");
  // The first `size` bytes of the open file `fd` as a uint8 tensor over a private mapping guarded by a read lease
  // (leased_mapping/leased_mapping.cpp): a writer of the file gets the bytes copied into memory first. Empty when
  // no lease can be taken (the caller then copies); `path` names the file in warnings.
  m.def("map_file_leased(int fd, int size, str path) -> Tensor");

  // A process group's one shared-memory group (csrc/shm/; shm_bindings/shared_group.h), which accel's c10d backend and
  // accel's own collectives share. A group is an integer handle: created on every rank with the same token, attached
  // once every rank knows every locator (the [pid, fd] where a peer opens a rank's segment), set up once every rank
  // has attached (accel.wire.shm_process_group does this).
  m.def("shm_group_create(int rank, int world, str token, int slot_bytes, float timeout_s, bool oversubscribed) -> int");
  m.def("shm_group_locator(int group) -> int[]");
  m.def("shm_group_attach(int group, int[] locators) -> ()");
  m.def("shm_group_finish_setup(int group) -> ()");
  m.def("shm_group_destroy(int group) -> ()");
  // One rendezvous for a whole pytree: every rank's leaves concatenated along dim 0 in rank order; with
  // pad_dim, each rank's leaf is first padded along it to the largest size (pad_value, before the data when
  // pad_first). Without pad_dim, dim 0 may differ between ranks and every other dim must agree. `call` names
  // the collective for the error raised when ranks run different ones (so do the two ops below).
  m.def("shm_all_gather(int group, Tensor[] leaves, int? pad_dim, Scalar pad_value, bool pad_first, str call) -> Tensor[]");
  // Every rank's 1-d uint8 tensor (any length) concatenated in rank order, and each rank's length (int64).
  m.def("shm_all_gather_bytes(int group, Tensor data, str call) -> (Tensor, Tensor)");
  // pad_across_processes in one rendezvous of shapes: the padded copies of the leaves that are smaller along
  // dim than on some rank (HF's semantics), and their indices in `leaves`.
  m.def("shm_pad_across_processes(int group, Tensor[] leaves, int dim, Scalar pad_value, bool pad_first) -> (Tensor[], int[])",
        {at::Tag::dynamic_output_shape});

  // out[i] = parts[0][i] op parts[1][i] op ... in that fixed order (cpu/reduce_in_order.cpp): the arithmetic of
  // accel's shared-memory process group. op: sum, avg, product, min, max, band, bor, bxor, premul_sum (the sum
  // times factor); fp16/bf16 combine in fp32 and round once.
  m.def("reduce_in_order_(Tensor[] parts, str op, Tensor(a!) out, float factor=1.0) -> ()");

  // targets[i] = sources[i] for every pair (same dtype and shape, CPU), large contiguous tensors with non-temporal
  // stores (cpu/stream_copy.cpp): the staging copy of an asynchronous sharded save, written now and read once
  // later by the checkpoint worker, so its lines need not pass through the cache. Equals torch._foreach_copy_.
  m.def("stream_copy_(Tensor(a!)[] targets, Tensor[] sources) -> ()");
}
