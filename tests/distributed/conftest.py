"""A two-node local Ray cluster (one per test module that asks for it).

The cluster is kept light for a 2-core machine: one CPU per node, a 100 MB object
store, no dashboard, worker logs not forwarded to the driver.

Why Ray is pinned below 2.54 (pyproject's ``ray`` extra; measured on the 2-core test
machine, see docs/scale-out.md): from 2.54 the raylet blocks its own start until the
node's dashboard agent (a Python process Ray always starts, dashboard or not) has
written its metrics-agent port file, and aborts after 15 s. Under load that agent
alone took 19-25 s to import, so the raylet died and the node timed out at fixture
setup ("The current node timed out during startup ... metrics_agent_port"). Up to
2.53 the raylet registers at once and the agent joins when it is ready. The settings
below give Ray's agents a start-up budget that survives a loaded machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

for _k, _v in {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_RECORD_ACTOR_TASK_LOGGING": "0",
    # How long the raylet waits for its (Python) agents to register, among them the
    # runtime-env agent every new worker needs: 30 s by default, 2 min here.
    "RAY_agent_register_timeout_ms": "120000",
}.items():
    os.environ.setdefault(_k, _v)

_STORE = 100 * 1024 * 1024


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """Two Ray nodes on this machine (1 CPU each), the driver connected to them."""
    ray = pytest.importorskip(
        "ray",
        reason="backend='ray' tests need Ray (pip install 'nbengine[ray]')",
        exc_type=ImportError,
    )
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": _STORE, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, object_store_memory=_STORE)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
