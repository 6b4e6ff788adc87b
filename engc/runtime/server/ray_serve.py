"""engc on Ray Serve, for many hosts: each replica is an `engc run` server (the engine and the whole
OpenAI + Anthropic app) in a Ray actor holding one GPU, Ray's HTTP proxy on every node routes to them,
and Ray's autoscaler adds or removes replicas by the requests each one holds (queued or running). Ray is
the cluster manager; engc adds only this deployment (docs/deploy.md).

    serve run engc.runtime.server.ray_serve:app bundle=/models/llama-8b name=llama max_replicas=8

The bundle's path must hold the bundle on every node (a shared file system, or the same copy on each).
"""
from __future__ import annotations

import dataclasses

from ray import serve
from ray.serve import Application

from engc.runtime.engine import EngineConfig
from engc.runtime.heap import settle_heap
from engc.runtime.server.app import build_server


@serve.ingress()
class EngcReplica:
    """One engine and engc's FastAPI app, built in the replica (nothing of it is pickled)."""

    def __init__(self, bundle: str, model_name: str | None, engine: dict, api_key: str | None, device: str):
        # not self.app: the ingress wrapper's property of that name is Serve's
        self.server, self.engine = build_server(bundle, EngineConfig(**engine), model_name, api_key, device)
        settle_heap()   # the replica serves as engc run does

    def __serve_build_asgi_app__(self):
        return self.server

    def __del__(self):   # Serve's graceful shutdown of the replica
        if hasattr(self, "engine"):
            self.engine.shutdown()


def deployment(bundle: str, name: str | None = None, device: str = "cuda", min_replicas: int = 1,
               max_replicas: int = 1, target_ongoing_requests: float = 32, max_ongoing_requests: int = 256,
               cpus_per_replica: float = 1, api_key: str | None = None, **engine) -> Application:
    """The Serve application: replicas of `bundle` served as model `name` (default: the bundle's).

    device "cuda" gives each replica one GPU, so Ray places one per GPU across the cluster; "cpu" gives
    each cpus_per_replica cores. Ray scales between min_replicas and max_replicas to keep about
    target_ongoing_requests requests (queued at Ray's proxies and handles, or running) per replica, and
    hands a replica at most max_ongoing_requests at once, the rest waiting in Ray's queue. engine:
    EngineConfig fields (max_num_seqs, num_blocks, max_waiting, ...)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device}: cuda (a GPU a replica) or cpu")
    gpus = 1 if device == "cuda" else 0
    scaling = {"min_replicas": int(min_replicas), "max_replicas": int(max_replicas),
               "target_ongoing_requests": float(target_ongoing_requests)}
    return serve.deployment(EngcReplica, name="engc", max_ongoing_requests=int(max_ongoing_requests),
                            autoscaling_config=scaling,
                            ray_actor_options={"num_gpus": gpus, "num_cpus": float(cpus_per_replica)}).bind(
        bundle, name, _typed(engine), api_key, device)


def _typed(engine: dict) -> dict:
    """EngineConfig fields given as text (serve run's key=value) in their types; others kept as given."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
    typed = {}
    for key, value in engine.items():
        if key not in kinds:
            raise TypeError(f"{key}: not an engine setting (EngineConfig: {', '.join(kinds)})")
        if isinstance(value, str):
            kind = kinds[key]
            value = (value.lower() in ("1", "true", "yes") if kind == "bool" else
                     float(value) if kind == "float" else int(value))
        typed[key] = value
    return typed


def app(args: dict[str, str]) -> Application:
    """`serve run engc.runtime.server.ray_serve:app bundle=PATH key=value ...`: deployment()'s arguments
    as text (numbers converted there)."""
    return deployment(**args)
