"""Scale out on Ray Serve: N replicas, each owning one `LoraManager`, behind one HTTP ingress.

    python -m lora_manager serve --replicas 2 [--preset tiny] [--port 8000] [--routing affinity|default]

`POST /generate` takes JSON {"prompt", "adapter", "strength", "seed", "steps"} and answers {"image_png_base64",
"info"} (info as in `Result.info`, plus the replica that served it). Adapter ids are Ray Serve's multiplexed model
ids and each replica's CPU store is its adapter cache. Routing:

- `default`: Ray Serve's own multiplexed routing (power of two choices among replicas that hold the id);
- `affinity`: `AdapterAffinityRouter`: the least busy replica, and among equally busy ones the replica where the
  request's adapter is live (`routing.py`).

A request whose replica dies is retried on another one by the ingress (generation is deterministic in its seed, so
a retry returns the same image and each request gets exactly one answer).
"""


import asyncio  # no `from __future__ import annotations`: FastAPI reads the body type at runtime
import base64
import io
import logging
from collections import Counter
from typing import Any

import ray
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from .errors import LoraManagerError
from .routing import rank_by_affinity

log = logging.getLogger(__name__)

RETRIES = 3  # attempts per request when a replica dies under it
ROUTINGS = ("affinity", "default")
api = FastAPI(title="lora-hotswap")


class GenerateBody(BaseModel):
    prompt: str
    adapter: str | list | None = None  # an id, or ids / [id, strength] pairs up to the replicas' slots
    strength: float = 1.0
    seed: int = 0
    steps: int | None = None


def _routing_key(adapter: str | list | None) -> str:
    """The multiplexed model id: the adapter, or the first of a combination ('' for the base model). Defined above
    the deployments: Ray serializes a deployment class when it is decorated, with the globals it finds then."""
    if isinstance(adapter, list) and adapter:
        first = adapter[0]
        return first if isinstance(first, str) else str(first[0])
    return adapter if isinstance(adapter, str) else ""


class AdapterAffinityRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router: the least busy replica, preferring the one where the request's adapter (its
    multiplexed model id) is live.

    One router runs in each caller of the handle (here: the ingress) and sees every request it routes, so its
    counts of requests in flight and of the adapter last sent to each replica have no polling lag.
    """

    def initialize_state(self, **kwargs) -> None:
        self._last: dict[str, str] = {}
        self._in_flight: Counter[str] = Counter()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        adapter = pending_request.metadata.multiplexed_model_id if pending_request else ""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranks = rank_by_affinity(adapter, list(by_id), self._last, self._in_flight)
        return [[by_id[i] for i in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        replica = replica_id.unique_id
        self._last[replica] = pending_request.metadata.multiplexed_model_id
        self._in_flight[replica] += 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._in_flight[replica_id.unique_id] = max(0, self._in_flight[replica_id.unique_id] - 1)


@serve.deployment
class LoraReplica:
    """One replica: one pipeline, one template, one CPU adapter cache."""

    def __init__(self, preset: str, compile: bool | None, slots: int, threads: int | None):
        import torch

        from .engine import LoraManager

        if threads:
            torch.set_num_threads(threads)
        self.manager = LoraManager.from_preset(preset, compile=compile, slots=slots)
        self.name = serve.get_replica_context().replica_id.unique_id

    @serve.multiplexed(max_num_models_per_replica=1024)
    async def adapter(self, adapter_id: str) -> str:
        """Ray's model load: the manager read every catalog adapter into its CPU store at start; unknown ids raise."""
        self.manager.info(adapter_id)
        return adapter_id

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        if serve.get_multiplexed_model_id():  # the routing key: the request's (first) adapter
            await self.adapter(serve.get_multiplexed_model_id())
        result = await asyncio.to_thread(
            self.manager.generate, body["prompt"], body["adapter"], body["strength"], body["seed"], body["steps"]
        )
        buffer = io.BytesIO()
        result.image.save(buffer, format="PNG")
        return {
            "image_png_base64": base64.b64encode(buffer.getvalue()).decode(),
            "info": {**result.info, "replica": self.name},
        }

    def describe(self) -> dict[str, Any]:
        """What a front end needs to present this replica's engine (`remote.RemoteManager`)."""
        m = self.manager
        return {"replica": self.name, "target_rank": m.target_rank, "slots": len(m.slots), "compiled": m.compiled,
                "adapters": [a.as_dict() for a in m.adapters()], "errors": m.errors, "stats": m.stats()}


@serve.deployment
@serve.ingress(api)
class Ingress:
    """HTTP front: validates the body, tags the call with its adapter, retries when a replica dies."""

    def __init__(self, replicas: DeploymentHandle):
        self.replicas = replicas

    @api.post("/generate")
    async def generate(self, body: GenerateBody) -> dict[str, Any]:
        handle = self.replicas.options(multiplexed_model_id=_routing_key(body.adapter))
        for attempt in range(1, RETRIES + 1):
            try:
                answer = await handle.generate.remote(body.model_dump())
                answer["info"]["attempts"] = attempt
                return answer
            except LoraManagerError as e:  # a bad request: the replica is fine, do not retry
                raise HTTPException(status_code=400, detail=str(e)) from e
            except RayActorError as e:
                log.warning("replica died under a request (attempt %d of %d): %s", attempt, RETRIES, e)
        raise HTTPException(status_code=503, detail=f"no replica could serve the request in {RETRIES} attempts")

    @api.get("/info")
    async def info(self) -> dict[str, Any]:
        """One replica's engine: target rank, slots, adapters (as `AdapterInfo`), stats."""
        return await self.replicas.describe.remote()


def build_app(
    preset: str = "tiny",
    replicas: int = 2,
    routing: str = "affinity",
    compile: bool | None = None,
    slots: int = 1,
    max_ongoing_requests: int = 2,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    threads: int | None = None,
):
    """The Serve application: `replicas` engines behind the ingress, routed by `routing`."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    options: dict[str, Any] = {
        "num_replicas": replicas,
        "max_ongoing_requests": max_ongoing_requests,  # a full replica is skipped: the router tries the next
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
    }
    if routing == "affinity":
        options["request_router_config"] = RequestRouterConfig(request_router_class=AdapterAffinityRouter)
    return Ingress.bind(LoraReplica.options(**options).bind(preset, compile, slots, threads))


def app_builder(args: dict[str, Any]):
    """For Serve config files (KubeRay `serveConfigV2`): `import_path: lora_manager.serve:app_builder`, `args` as
    `build_app`'s keywords."""
    return build_app(**args)


def main(args) -> None:
    """`python -m lora_manager serve`: a local Ray instance (or `--address`), the app on `--host:--port`."""
    import torch

    ray.init(address=args.address, include_dashboard=False)
    gpus = 1.0 if torch.cuda.is_available() else 0.0
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(args.preset, args.replicas, args.routing, args.compile, args.slots, num_gpus=gpus,
                    num_cpus=args.cpus_per_replica)
    serve.run(app, name="lora-hotswap", route_prefix="/", blocking=True)
