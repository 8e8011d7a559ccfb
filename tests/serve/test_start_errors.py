"""Starting the replicas without Ray, or against a cluster that is not there: the error names the setting."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from chat.config import load_config  # noqa: E402
from serve.cluster import ServeError, start_replicas  # noqa: E402


def test_a_cluster_that_is_not_there_is_named():
    if ray.is_initialized():
        ray.shutdown()
    cfg = load_config(overrides=["serve.replicas=2", "serve.ray_address=127.0.0.1:1"], environ={})
    with pytest.raises(ServeError, match=r"could not join the Ray cluster at 127.0.0.1:1 \(serve.ray_address='127.0.0.1:1'\)"):
        start_replicas(cfg)


def test_more_replicas_than_the_cluster_has_cpus_for_is_named():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        cfg = load_config(overrides=["serve.replicas=3", "serve.replica_cpus=1"], environ={})
        with pytest.raises(ServeError, match=r"serve.replicas=3 x serve.replica_cpus=1 needs 3 CPUs; the Ray "
                                             r"cluster has 2"):
            start_replicas(cfg)
    finally:
        ray.shutdown()
