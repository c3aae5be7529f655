"""accel.cpu_affinity: disjoint, NUMA-aware CPU sets per local rank, read from (fake and real) sysfs, and
set_numa_affinity pinning real ranks."""

import os

import pytest
from spawn_pool import run_on_ranks

from accel import cpu_affinity
from accel.cpu_affinity import (
    cpu_affinity_for,
    numa_nodes,
    parse_cpu_list,
    physical_cores,
    plan_affinity,
)

# 2 NUMA nodes of 8 cores with 2 hyperthreads each: core i is CPUs (i, i + 16).
TWO_NODES = [[(i, i + 16) for i in range(8)], [(i, i + 16) for i in range(8, 16)]]
FOUR_NODES_UNEVEN = [
    [(i,) for i in range(0, 6)],
    [(i,) for i in range(6, 8)],
    [(i,) for i in range(8, 12)],
    [(i,) for i in range(12, 13)],
]


def _node_of(cpu, nodes):
    return next(index for index, cores in enumerate(nodes) if any(cpu in core for core in cores))


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("") == []


@pytest.mark.parametrize("nodes", [TWO_NODES, FOUR_NODES_UNEVEN], ids=["two-nodes", "four-uneven-nodes"])
def test_plans_are_disjoint_and_numa_local(nodes):
    cpus = {cpu for cores in nodes for core in cores for cpu in core}
    for world_size in range(1, len(cpus) + 1):
        plan = plan_affinity(nodes, world_size)
        assert len(plan) == world_size and all(plan)
        assert sum(map(len, plan)) == len(set().union(*plan)), f"overlap at {world_size} ranks"
        assert set().union(*plan) <= cpus
        if world_size >= len(nodes):
            assert all(len({_node_of(cpu, nodes) for cpu in rank_cpus}) == 1 for rank_cpus in plan)
        else:  # fewer ranks than nodes: whole nodes each, every CPU used
            assert set().union(*plan) == cpus


def test_ranks_get_whole_cores_and_fill_nodes_in_order():
    plan = plan_affinity(TWO_NODES, 4)
    assert plan == [
        {0, 1, 2, 3, 16, 17, 18, 19},
        {4, 5, 6, 7, 20, 21, 22, 23},
        {8, 9, 10, 11, 24, 25, 26, 27},
        {12, 13, 14, 15, 28, 29, 30, 31},
    ]
    for world_size in (2, 4, 8, 16):
        for rank_cpus in plan_affinity(TWO_NODES, world_size):
            assert all((cpu + 16 in rank_cpus) for cpu in rank_cpus if cpu < 16)  # both threads of each core


def test_ranks_follow_node_sizes():
    plan = plan_affinity(FOUR_NODES_UNEVEN, 6)
    nodes = [_node_of(min(rank_cpus), FOUR_NODES_UNEVEN) for rank_cpus in plan]
    per_node = [nodes.count(node) for node in range(4)]
    assert per_node == [2, 1, 2, 1]


def test_more_ranks_than_cpus_share_round_robin(caplog):
    plan = plan_affinity([[(0,), (1,)]], 3)
    assert plan == [{0}, {1}, {0}]
    assert "share 2 CPUs" in caplog.text
    with pytest.raises(ValueError, match="at least 1"):
        plan_affinity(TWO_NODES, 0)


def _fake_sysfs(root, nodes):
    for index, cores in enumerate(nodes):
        node_dir = root / "node" / f"node{index}"
        node_dir.mkdir(parents=True)
        node_dir.joinpath("cpulist").write_text(",".join(str(cpu) for core in cores for cpu in core) + "\n")
        for core in cores:
            for cpu in core:
                topology = root / "cpu" / f"cpu{cpu}" / "topology"
                topology.mkdir(parents=True)
                topology.joinpath("thread_siblings_list").write_text(",".join(map(str, core)) + "\n")


def test_topology_from_sysfs(tmp_path):
    _fake_sysfs(tmp_path, TWO_NODES)
    allowed = frozenset(range(32)) - {3, 19, 31}  # e.g. a cpuset without core 3 and half of core 15
    nodes = numa_nodes(allowed, tmp_path)
    assert nodes == [
        sorted((set(range(8)) | set(range(16, 24))) - {3, 19}),
        sorted(set(range(8, 16)) | set(range(24, 31))),
    ]
    cores = physical_cores(nodes[1], tmp_path)
    assert cores[-1] == (15,) and cores[0] == (8, 24)


def test_no_numa_information_is_one_node(tmp_path):
    assert numa_nodes(frozenset({0, 1, 2}), tmp_path) == [[0, 1, 2]]
    assert physical_cores([0, 1], tmp_path) == [(0,), (1,)]


def test_on_this_machine():
    allowed = set(os.sched_getaffinity(0))
    sets = [cpu_affinity_for(rank, 2) for rank in range(2)]
    assert set().union(*sets) <= allowed
    if len(allowed) >= 2:
        assert not sets[0] & sets[1]
    with pytest.raises(ValueError, match="local_rank must be in 0..1"):
        cpu_affinity_for(2, 2)


def test_gpu_local_cpus_follow_cuda_visible_devices(tmp_path, monkeypatch):
    gpus = [["0", "GPU-aaaa", "00000000:19:00.0"], ["1", "GPU-bbbb", "00000000:9A:00.0"]]
    monkeypatch.setattr(cpu_affinity, "query_gpus", lambda *fields: gpus)
    for address, cpus in (("0000:19:00.0", "0-1"), ("0000:9a:00.0", "1")):
        (tmp_path / address).mkdir()
        (tmp_path / address / "local_cpulist").write_text(cpus + "\n")
    inherited = cpu_affinity.inherited_cpus()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert cpu_affinity.gpu_local_cpus(0, tmp_path) == ({1} & inherited or None)
    assert cpu_affinity.gpu_local_cpus(1, tmp_path) == ({0, 1} & inherited or None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bb")
    assert cpu_affinity.gpu_local_cpus(0, tmp_path) == ({1} & inherited or None)
    assert cpu_affinity.gpu_local_cpus(1, tmp_path) is None


def _pinned_cpus():
    original = os.sched_getaffinity(0)
    try:
        cpu_affinity.set_numa_affinity(int(os.environ["LOCAL_RANK"]))
        return sorted(os.sched_getaffinity(0))
    finally:
        os.sched_setaffinity(0, original)  # the pool's workers are reused by other tests
        cpu_affinity.set_numa_affinity.cache_clear()


def test_set_numa_affinity_pins_each_rank():
    pinned = run_on_ranks(_pinned_cpus, 2)
    allowed = sorted(os.sched_getaffinity(0))
    assert pinned == [sorted(cpu_affinity_for(rank, 2)) for rank in range(2)]
    assert all(set(cpus) <= set(allowed) for cpus in pinned)
    if len(allowed) >= 2:
        assert not set(pinned[0]) & set(pinned[1])


def _pinned_by_partial_state():
    from accel.state import PartialState

    original = os.sched_getaffinity(0)
    try:
        PartialState()
        pinned = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, original)
        PartialState._reset_state()
        PartialState()  # the pinning is done once per process (cached), as in HF
        return pinned, os.sched_getaffinity(0) == original
    finally:
        os.sched_setaffinity(0, original)
        cpu_affinity.set_numa_affinity.cache_clear()


def test_partial_state_pins_each_rank_when_cpu_affinity_is_asked(monkeypatch):
    monkeypatch.setenv("ACCELERATE_CPU_AFFINITY", "1")  # HF's name; ACCEL_CPU_AFFINITY works too
    results = run_on_ranks(_pinned_by_partial_state, 2)
    assert results == [(sorted(cpu_affinity_for(rank, 2)), True) for rank in range(2)]


@pytest.mark.gpu
def test_gpu_local_cpus_on_this_machine():
    cpus = cpu_affinity.gpu_local_cpus(0)
    assert cpus is None or (cpus and cpus <= cpu_affinity.inherited_cpus())
