// Every accel op schema, declared once. Kernels register per backend in cpu/<family>.cpp and
// cuda/<family>.cu; accel/ops.py holds the Python wrapper and fake (meta) kernel of each.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing accel._C only has to run the static registrations below, so the module is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(accel, m) {
  // Writes src into out along dim (out.size(dim) >= src.size(dim)) and pad_value everywhere else; the
  // padding goes before the data when pad_first. The pack step of the padded all-gather.
  m.def("pad_into(Tensor src, int dim, Scalar pad_value, bool pad_first, Tensor(a!) out) -> ()");
}
