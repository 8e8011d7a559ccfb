"""Ray Serve for the front door: the Ray cluster joined or started, the model replicas deployed, and the shared
bank's store made reachable to them."""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable

import ray  # the extra `scale`: without it, importing this module says what to install

from chat.config import Config
from chat.worker import describe
from memory import MemoryVectorDB
from serve.replica import ChatReplica

APP, DEPLOYMENT = "recall-chat", "ChatReplica"
ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


class ServeError(RuntimeError):
    """The replicas could not be started or reached; the message names the setting to look at."""


def shared_store(cfg: Config) -> Config:
    """`cfg` as the replicas get it. A milvus-lite store is a file only one process may open: this one (the
    front door) opens it and serves it to the replicas on this machine at its http address; a Milvus server
    URI goes to the replicas as it is. Refuses to start, naming the URI, when nothing answers there."""
    mem = cfg.memory
    if mem.store != "milvus":
        return cfg
    from memory.milvus import MilvusBank, StoreError, load_into

    client = MilvusBank.connect(mem.milvus_uri)
    if mem.bank is not None and not client.has_collection(mem.milvus_collection):
        # filled once, here, from the bank file (checked as any bank file), before any replica opens it
        load_into(MemoryVectorDB.load(mem.bank), mem.milvus_uri, mem.milvus_collection, index=mem.index,
                  client=client)
    if mem.milvus_uri.startswith(("http://", "https://", "tcp://", "unix:")):
        return cfg
    if cfg.serve.ray_address is not None:
        raise StoreError(f"memory.milvus_uri={mem.milvus_uri!r} is a milvus-lite file, which only this machine "
                         f"can reach; with a Ray cluster (serve.ray_address={cfg.serve.ray_address!r}) use a "
                         "Milvus server: memory.milvus_uri=http://host:19530")
    from milvus_lite.server_manager import server_manager_instance  # the same server for the same file

    uri = server_manager_instance.start_and_get_uri(mem.milvus_uri)
    if uri is None:
        raise StoreError(f"could not serve the milvus-lite file memory.milvus_uri={mem.milvus_uri!r} to the replicas")
    return dataclasses.replace(cfg, memory=dataclasses.replace(mem, milvus_uri=uri))


def start_replicas(cfg: Config, loader: Callable | None = None, name: str = APP):
    """Start (or join) Ray, and run `serve.replicas` replicas of the model as the Serve application `name`;
    their handle."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    cfg = shared_store(cfg)
    address = cfg.serve.ray_address
    if not ray.is_initialized():
        try:
            _reachable(address)
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        except Exception as e:  # noqa: BLE001 - Ray raises many kinds (ConnectionError, RuntimeError, ...)
            where = "start a local Ray" if address is None else f"join the Ray cluster at {address}"
            raise ServeError(f"could not {where} (serve.ray_address={address!r}): {describe(e)}") from None
    want, have = cfg.serve.replicas * cfg.serve.replica_cpus, ray.cluster_resources().get("CPU", 0)
    if want > have:  # Serve would wait for them forever
        raise ServeError(f"serve.replicas={cfg.serve.replicas} x serve.replica_cpus={cfg.serve.replica_cpus} needs "
                         f"{want:g} CPUs; the Ray cluster has {have:g}: lower either, or add nodes")
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(
        ChatReplica, name=DEPLOYMENT, num_replicas=cfg.serve.replicas, max_ongoing_requests=64,
        max_constructor_retry_count=3,  # a model that does not load: say so, do not retry it 20 times
        logging_config={"enable_access_log": False, "log_level": "WARNING"},  # no log line a call
        ray_actor_options={"num_cpus": cfg.serve.replica_cpus, "num_gpus": cfg.serve.replica_gpus},
        request_router_config=RequestRouterConfig(request_router_class=ROUTER,
                                                  request_router_kwargs={"num_fallback_replicas": 0}))
    try:
        return serve.run(deployment.bind(cfg, loader), name=name, route_prefix=None)
    except Exception as e:  # noqa: BLE001 - a replica's constructor failed: say which and why
        try:  # the constructor's own error is in the deployment's status, not in serve.run's
            text = serve.status().applications[name].deployments[DEPLOYMENT].message + "\n" + str(e)
        except Exception:  # noqa: BLE001
            text = str(e)
        why = next((line.strip().removeprefix("RuntimeError: ") for line in text.splitlines()
                    if line.startswith("RuntimeError: model replica")), text[-2000:])
        raise ServeError(f"the model replicas did not start (serve.replicas={cfg.serve.replicas}): {why}") from None


def _reachable(address: str | None) -> None:
    """A `host:port` cluster address must accept a connection (ray.init would retry it for minutes)."""
    host, sep, port = (address or "").removeprefix("ray://").rpartition(":")
    if address is None or not sep or not port.isdigit():
        return
    with socket.create_connection((host, int(port)), timeout=10):
        pass


def live_replicas() -> list[str]:
    """The live replica actors of the deployment (Ray Serve names them by replica id)."""
    prefix = f"SERVE_REPLICA::{APP}#{DEPLOYMENT}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(prefix))
