"""One rank of bench_gather's first call, as the benchmark makes it: a gloo default group, accel's and HF's
PartialState, the shared-memory transport, then pad_across_processes + gather of 64 - rank uint8 elements."""

import faulthandler
import os

faulthandler.enable()
import accelerate as hf
import torch
import torch.distributed as dist

from accel.collectives import gather, pad_across_processes
from accel.state import PartialState
from accel.wire.transport_selection import select_transport

dist.init_process_group("gloo")
state = PartialState()
hf.PartialState(cpu=True)
transport = select_transport([])
rank = state.process_index
print(f"rank {rank}: {type(transport).__name__}, {torch.get_num_threads()} threads, pid {os.getpid()}", flush=True)
x = torch.ones(64 - rank, dtype=torch.uint8) * rank
print(f"rank {rank}: calling pad_across_processes", flush=True)
padded = pad_across_processes(x)
print(f"rank {rank}: padded to {tuple(padded.shape)}; calling gather", flush=True)
ours = gather(padded)
assert torch.equal(ours, hf.utils.gather(hf.utils.pad_across_processes(x)))
print(f"rank {rank}: ok", flush=True)
