"""A local Ray instance on this machine's loopback only, for accel's Ray Train test and benchmark
(tests/integrations/jobs/ray_train_job.py, benchmarks/ray_job.py): neither may send traffic beyond 127.0.0.0/8, and Ray
picks the machine's external interface unless pinned.

`LOOPBACK_ENV` goes into the environment of the process that starts Ray (Ray and its workers read it from there);
`start_ray` starts the instance on 127.0.0.1; `not_loopback(reported_addresses())` names every address Ray reports
that is not a loopback one, which the caller checks before anything runs. Not part of HF's `accelerate.test_utils`.
"""

from __future__ import annotations

import ipaddress
import os

LOOPBACK_ENV = {
    # 127.0.0.1 alone is not enough: Ray swaps a loopback node address for the machine's own unless it runs as a
    # one-machine instance.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage report to Ray's servers
    "RAY_AUTH_MODE": "disabled",  # no token files
    "GLOO_SOCKET_IFNAME": "lo",  # the group Ray Train starts: gloo on loopback
}


def start_ray(folder: str, num_cpus: int = 2) -> None:
    """`ray.init` of a local instance on 127.0.0.1, its session files under `folder`/ray, no dashboard."""
    import ray

    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        _temp_dir=os.path.join(folder, "ray"),
        num_cpus=num_cpus,
        log_to_driver=False,
    )


def reported_addresses() -> dict:
    """Every address the running Ray instance reports: the node's, each node's manager, the GCS."""
    import ray

    gcs_host = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "nodes": [node["NodeManagerAddress"] for node in ray.nodes()],
        "gcs": gcs_host,
    }


def not_loopback(addresses: dict) -> list[str]:
    """The addresses of `reported_addresses()` that are not loopback ones."""
    flat = [addresses["node_ip"], addresses["gcs"], *addresses["nodes"]]
    return [address for address in flat if not ipaddress.ip_address(address.strip("[]")).is_loopback]
