"""Peak host memory of load_checkpoint_and_dispatch on a ~1 GiB checkpoint, measured in a fresh process: the
model itself plus about one shard, never the checkpoint twice."""

import json
import subprocess
import sys
import textwrap

WRITE = textwrap.dedent(
    """
    import sys, torch
    from accel.checkpoint import save_state_dict
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(16)])  # 16 x 64 MiB
    save_state_dict(model.state_dict(), sys.argv[1], max_shard_size="256MB", progress=False)
    """
)

LOAD = textwrap.dedent(
    """
    import json, resource, sys, torch
    from accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch

    def rss_peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def rss_now():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    with init_empty_weights():
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(16)])
    before = rss_now()
    load_checkpoint_and_dispatch(model, sys.argv[1], device_map={"": "cpu"})
    print(json.dumps({"before": before, "peak": rss_peak(), "after": rss_now(),
                      "first": model[0].weight[0, :3].tolist()}))
    """
)


def test_loading_a_1gib_checkpoint_needs_the_model_plus_about_one_shard(tmp_path):
    folder = tmp_path / "ckpt"
    subprocess.run([sys.executable, "-c", WRITE, str(folder)], check=True, timeout=300)
    result = subprocess.run(
        [sys.executable, "-c", LOAD, str(folder)], check=True, timeout=300, capture_output=True, text=True
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    model_bytes = 16 * 4096 * 4096 * 4
    largest_shard = 4 * 4096 * 4096 * 4
    grew = measured["peak"] - measured["before"]
    assert grew <= model_bytes + largest_shard + (128 << 20), measured
    assert measured["after"] - measured["before"] >= model_bytes * 0.95  # the weights really are in memory
