"""The join of gpuguard's metrics with dcgm-exporter's in docs/admin.md (Metrics), on a real scrape: dcgm-exporter
labels a GPU `gpu="<NVML index>"` and `UUID`, gpuguard labels it `gpu="<minor>"` and `uuid`; the
simulation numbers index and minor apart (minor 0 is index 2), so a join on `gpu` picks another
GPU, and the join on the UUID the docs give picks the right one."""
from __future__ import annotations

import re

import pynvml
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import open_backend
from test_metrics import scrape, value

from devtools.harness import free_port, wait_for

README_JOIN = re.compile(r'DCGM_FI_DEV_FB_USED \* on\(UUID\) group_left\(user\)\s+'
                         r'label_replace\(gpuguard_gpu_holder, "UUID", "\$1", "uuid", "\(\.\+\)"\)')


def dcgm_exposition(config_path) -> str:
    """What dcgm-exporter serves for these GPUs: one series per NVML index, read from NVML itself."""
    lines = ["# TYPE DCGM_FI_DEV_FB_USED gauge"]
    with open_backend(config_path):
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            lines.append(f'DCGM_FI_DEV_FB_USED{{gpu="{index}",UUID="{pynvml.nvmlDeviceGetUUID(handle)}",'
                         f'device="nvidia{pynvml.nvmlDeviceGetMinorNumber(handle)}",Hostname="gpu1"}} '
                         f"{1000 + index}")
    return "\n".join(lines) + "\n"


def test_the_readme_join_on_uuid_finds_the_holders_gpu_where_a_join_on_gpu_would_not(start_daemon):
    readme = open("docs/admin.md").read()
    assert README_JOIN.search(readme), "the dcgm-exporter join in docs/admin.md changed: update this test with it"
    port = free_port()
    d = start_daemon(defaults={"gpus": 1}, metrics={"listen": f"127.0.0.1:{port}"})
    alice = d.add_member()
    (minor,) = d.open_session(alice)["gpus"]
    ours = wait_for(lambda: (m := scrape(port)) and value(m, "gpuguard_gpu_holder", user=alice.name) and m)
    dcgm = [s for family in text_string_to_metric_families(dcgm_exposition(d.config_path)) for s in family.samples]

    # label_replace copies uuid into UUID; on(UUID) group_left(user) keeps each DCGM series with its holder
    holders = {dict(labels)["uuid"]: dict(labels)["user"]
               for (name, labels), v in ours.items() if name == "gpuguard_gpu_holder"}
    joined = [(s.labels["gpu"], s.labels["device"], holders[s.labels["UUID"]], s.value)
              for s in dcgm if s.labels["UUID"] in holders]

    info = {dict(labels)["gpu"]: dict(labels) for (name, labels), _ in ours.items() if name == "gpuguard_gpu_info"}
    index = int(info[str(minor)]["index"])
    assert index != minor  # otherwise this test could not tell the joins apart
    assert joined == [(str(index), f"nvidia{minor}", alice.name, 1000 + index)]
    # the naive join on `gpu` pairs alice with the series of another GPU
    (naive,) = [s for s in dcgm if s.labels["gpu"] == str(minor)]
    assert naive.labels["device"] != f"nvidia{minor}"
