// Python types accel._C defines besides its ops; the module's init (ops.cpp) adds them.
#pragma once

#include <Python.h>

namespace accel {

// Adds the process group backends' classes (shm_bindings/shm_process_group.cpp, host_leader_backend.cpp) and the
// collectives' direct entries (shm_bindings/shm_transport.cpp) to `module`. Returns 0, or -1 with a Python
// exception set.
int add_python_types(PyObject* module);

}  // namespace accel
