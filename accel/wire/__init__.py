"""The wire: how accel's processes talk, below the process state (`accel.state`) and HF's operations above it
(`accel.collectives`).

- process_group.py: the default group (starting or adopting it, its timeout, its barrier, run attempts);
- shm_process_group.py: accel's c10d backend (collectives of CPU tensors through shared memory, gloo as delegate),
  which sets up the process group's one shared-memory group;
- same_host.py: the facts every rank states and the rules by which ranks decide they can share memory;
- transport.py / shm_transport.py / transport_selection.py: what accel's own collectives run on (torch's
  collectives, or native calls on the process group's shared-memory group) and which one a call uses;
- padding.py, ragged.py: HF's pad rule and the ragged all-gather the transports build on;
- uneven.py: the uneven-inputs protocol (`join_uneven_inputs`) every collective consults;
- gloo_workers.py: waiting for gloo's threads at exit.

Nothing here imports the process state, the strategies or HF's operations (tests/test_import_graph.py).
"""
