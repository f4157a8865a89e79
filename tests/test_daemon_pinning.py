"""The live daemon pins its engine thread where the node plan says, read back from that thread."""

import os
import re

from daemon_fixture import http, serving
from gpushare.node.affinity import plan_pinning
from gpushare.node.node_settings import parse_node_settings
from gpushare.node.topology import parse_cpulist, read_topology


def thread_cpus(pid: int, tid: int) -> list[int]:
    status = open(f"/proc/{pid}/task/{tid}/status").read()
    return parse_cpulist(re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M).group(1))


def test_engine_thread_affinity_matches_the_plan(tmp_path, smollm2_path):
    last_cpu = max(os.sched_getaffinity(0))
    node = {"cpus": [last_cpu]}
    with serving(tmp_path, smollm2_path, {"node": node}) as daemon:
        found = re.search(r"engine thread (\d+) pinned to CPUs ([\d,]+)", daemon.log())
        assert found, daemon.log()
        tid = int(found.group(1))
        expected = plan_pinning(read_topology("/"), parse_node_settings(node),
                                allowed_cpus=sorted(os.sched_getaffinity(0))).engines[0].cpus
        assert expected == [last_cpu]
        (device,) = http("GET", daemon.url + "/health")[1]["devices"]  # the one engine worker process
        assert device["worker_pid"] != daemon.proc.pid
        assert thread_cpus(device["worker_pid"], tid) == expected
