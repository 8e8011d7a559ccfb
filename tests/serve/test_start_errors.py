"""Starting the replicas without Ray, or against a cluster that is not there: the error names the setting."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from chat.config import load_config  # noqa: E402
from serve.front import ServeError, start_replicas  # noqa: E402


def test_a_cluster_that_is_not_there_is_named():
    if ray.is_initialized():
        ray.shutdown()
    cfg = load_config(overrides=["serve.replicas=2", "serve.ray_address=127.0.0.1:1"], environ={})
    with pytest.raises(ServeError, match=r"could not join the Ray cluster at 127.0.0.1:1 \(serve.ray_address='127.0.0.1:1'\)"):
        start_replicas(cfg)
