"""One process, a world-1 shared-memory group: each transport op once, printing before each call."""

import faulthandler
import secrets

faulthandler.enable()
import torch

from accel import _ext, ops

print("native:", _ext.status(), flush=True)
h = ops.shm_group_create(0, 1, secrets.token_hex(16), (4 << 20) + 4096, 60.0, False)
ops.shm_group_attach(h, ops.shm_group_locator(h))
ops.shm_group_finish_setup(h)
t = torch.ones(64, dtype=torch.uint8)
for name, call in [
    ("shm_all_gather_bytes", lambda: ops.shm_all_gather_bytes(h, t, "probe")),
    ("shm_pad_across_processes", lambda: ops.shm_pad_across_processes(h, [t], 0, 0, False)),
    ("shm_all_gather", lambda: ops.shm_all_gather(h, [t], call="gather")),
]:
    print("calling", name, flush=True)
    print("  ->", call(), flush=True)
ops.shm_group_destroy(h)
print("single-process probe passed", flush=True)
