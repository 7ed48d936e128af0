"""Real redis-server processes on loopback: one single node, and a 3-node Redis Cluster.

Nothing is faked. Without a redis-server binary (install: ``apt-get install -y redis-server``; CI's
.ci/run does it) every test here skips and says so.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from redis_helpers import NO_REDIS, REDIS, REDIS_CLI, SLOTS, RedisServer, free_port

import tiered_kv as tkv
from tiered_kv.tiers.cpu import CpuSlabs


@pytest.fixture
def redis_server(tmp_path):
    if REDIS is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


@pytest.fixture
def redis_cluster(tmp_path):
    """Three masters on loopback, slots spread by ``redis-cli --cluster create``."""
    if REDIS is None or REDIS_CLI is None:
        pytest.skip(NO_REDIS)
    nodes = []
    try:
        for i in range(3):
            extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
            nodes.append(RedisServer(tmp_path / f"node{i}", free_port(cluster=True), extra).start())
        seeds = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run([REDIS_CLI, "--cluster", "create", *seeds, "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        end = time.monotonic() + 15
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in nodes):
            if time.monotonic() > end:
                raise RuntimeError("redis cluster did not reach cluster_state:ok in 15 s")
            time.sleep(0.05)
        yield nodes
    finally:
        for n in nodes:
            n.kill()


@pytest.fixture
def slabs():
    s = CpuSlabs(tkv.KVLayout.from_block_bytes([8192, 512], num_blocks=4), SLOTS, pin="off")
    yield s
    s.release()


