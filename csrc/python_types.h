// Python types accel._C defines besides its ops; the module's init (ops.cpp) adds them.
#pragma once

#include <Python.h>

namespace accel {

// Adds the shared-memory process group's backend class (shm_bindings/shm_process_group.cpp) to `module`. Returns 0, or -1
// with a Python exception set.
int add_python_types(PyObject* module);

}  // namespace accel
