"""Scale out on Ray Serve: N replicas, each owning one `LoraManager`, behind one HTTP ingress.

    python -m lora_manager serve --replicas 2 [--preset tiny] [--port 8000] [--routing affinity|default]

`POST /v1/images/generations` and `GET /v1/models` speak the OpenAI Images API (`openai_api.py`; errors in its
shape, the same statuses), `GET /metrics` the Prometheus text format (`metrics.py`).
`POST /generate` takes JSON {"prompt", "adapter", "strength", "seed", "steps"} and answers {"image_png_base64",
"info"} (info as in `Result.info`, plus the replica that served it). A refused request gets a 4xx with
{"error": message, "field": the field at fault or null} (the engine's request schema, checked before anything is
queued), with the status of `statuses.py` that every route shares: 422 a bad field, 404 an unknown adapter, 413 a
body over `MAX_BODY_BYTES`, 429 busy (with `Retry-After`), 503 no replica left, 500 a fault with a plain message.
Adapter ids are Ray Serve's multiplexed model ids and each replica's CPU store is its adapter cache. Routing:

- `default`: Ray Serve's own multiplexed routing (power of two choices among replicas that hold the id);
- `affinity`: `AdapterAffinityRouter`: the least busy replica, and among equally busy ones the replica where the
  request's adapter is live (`routing.py`).

A request whose replica dies is retried on another one by the ingress (generation is deterministic in its seed, so
a retry returns the same image and each request gets exactly one answer).
"""

import asyncio  # no `from __future__ import annotations`: FastAPI reads the body type at runtime
import json
import logging
import time
from collections import Counter, deque
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from ..errors import (
    BodyTooLargeError,
    LoraManagerError,
    QueueFullError,
    ReplicasLostError,
    RequestError,
    UnknownAdapterError,
)
from ..request_schema import FIELDS, MAX_BODY_BYTES, check_request, shorten
from .metrics import ServeMetrics, replica_state
from .openai_api import Pipeline, error_body, models_list, parse_images_request
from .protocol import answer_body, request_body
from .routing import rank_by_affinity
from .statuses import RETRY, error_of, retry_after_s, status_of

log = logging.getLogger(__name__)

RETRIES = 3  # attempts per request when a replica dies under it
ROUTINGS = ("affinity", "default")
api = FastAPI(title="lora-hotswap")


def refusal(status: int, message: str, field: str | None = None) -> JSONResponse:
    """The error format of every refused request. Defined above the deployments: Ray serializes a deployment class
    when it is decorated, with the globals it finds then."""
    return JSONResponse({"error": message, "field": field}, status_code=status)


def error_answer(e: LoraManagerError) -> dict[str, Any]:
    """An engine refusal as data, so it crosses Ray without a traceback."""
    status = status_of(e)
    field = getattr(e, "field", None) or ("adapter" if isinstance(e, UnknownAdapterError) else None)
    return {"error": str(e), "field": field, "status": status}


async def read_json(request: Request) -> dict[str, Any]:
    """The JSON object of a request, read in chunks up to `MAX_BODY_BYTES`; raises RequestError."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise BodyTooLargeError(f"request body is larger than the limit of {MAX_BODY_BYTES} bytes.", field="body")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"request body is not valid JSON ({e.__class__.__name__}).", field="body") from e
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {shorten(body)}.", field="body")
    return body


async def read_body(request: Request) -> dict[str, Any]:
    """A `/generate` body: its JSON object with the fields of `FIELDS` only; raises RequestError."""
    body = await read_json(request)
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise RequestError(
            f"unknown field {shorten(unknown[0])}; the fields are {list(FIELDS)}.", field=unknown[0][:60]
        )
    if "prompt" not in body:
        raise RequestError("prompt is missing.", field="prompt")
    return {**request_body(body["prompt"]), **body}  # every field but the prompt may be left out


def openai_refusal(status: int, message: str, param: str | None, retry_after: int | None = None) -> JSONResponse:
    """An error in OpenAI's shape; a full queue adds `Retry-After`."""
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse(error_body(message, param, status), status_code=status, headers=headers)


class ServerBusyError(QueueFullError):
    """More images in flight than the ingress admits: answered with 429 and `Retry-After`."""


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


def replica_actors(app: str) -> dict[str, str]:
    """The live `LoraReplica` actors of `app`: replica id -> actor name (Serve names each replica's actor
    `SERVE_REPLICA::<app>#LoraReplica#<replica id>`)."""
    prefix = f"SERVE_REPLICA::{app}#{LoraReplica.name}#"
    named = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"].removeprefix(prefix): a["name"] for a in named if a["name"].startswith(prefix)}


def accepted_size(manager) -> dict[str, Any]:
    """The default image size and the multiple each side must be (the VAE's scale factor, twice that where the
    pipeline packs 2x2 latent patches as Flux does); a compiled denoiser serves its default size only."""
    pipe, defaults = manager.pipe, manager.generation_defaults
    scale = int(getattr(pipe, "vae_scale_factor", 8)) * (2 if hasattr(pipe, "_pack_latents") else 1)
    sample = getattr(pipe, "default_sample_size", None) or getattr(pipe.unet.config, "sample_size", 64)
    return {
        "width": int(defaults.get("width") or sample * scale),
        "height": int(defaults.get("height") or sample * scale),
        "multiple": scale,
        "fixed": bool(manager.compiled),
    }


def outcome(status: int) -> str:
    """The `outcome` label of `lora_requests_total`."""
    if status < 400:
        return "success"
    return {404: "not_found", 429: "busy", 503: "busy"}.get(status, "refused" if status < 500 else "error")


@serve.deployment
class LoraReplica:
    """One replica: one pipeline, one template, one CPU adapter cache."""

    def __init__(
        self,
        preset: str,
        compile: bool | None,
        slots: int,
        threads: int | None,
        max_batch: int = 1,
        dtype: str | None = None,
    ):
        import torch

        from ..engine import LoraManager

        if threads:
            torch.set_num_threads(threads)
        self.manager = LoraManager.from_preset(preset, compile=compile, slots=slots, max_batch=max_batch, dtype=dtype)
        self.name = serve.get_replica_context().replica_id.unique_id

    @serve.multiplexed(max_num_models_per_replica=1024)
    async def adapter(self, adapter_id: str) -> str:
        """Ray's model load: the manager read every catalog adapter into its CPU store at start; unknown ids raise."""
        self.manager.info(adapter_id)
        return adapter_id

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """The image, info and this replica's state, or the engine's refusal as {"error", "field", "status"}.
        `params` (OpenAI route only): pipeline keywords the ingress checked (size, guidance_scale)."""
        try:
            if serve.get_multiplexed_model_id():  # the routing key: the request's (first) adapter
                await self.adapter(serve.get_multiplexed_model_id())
            result = await asyncio.to_thread(
                self.manager.generate,
                body["prompt"],
                body["adapter"],
                body["strength"],
                body["seed"],
                body["steps"],
                **body.get("params", {}),
            )
        except LoraManagerError as e:
            return error_answer(e)
        return {**answer_body(result, replica=self.name), "replica_state": self.state()}

    def state(self) -> dict[str, Any]:
        """This replica's queue, adapters and cache, for `/metrics`."""
        return replica_state(self.manager, self.name)

    def describe(self) -> dict[str, Any]:
        """What a front end needs to present this replica's engine (`remote.RemoteManager`)."""
        m = self.manager
        return {
            "replica": self.name,
            "base_model": m.model_name,
            "target_rank": m.target_rank,
            "slots": m.max_adapters,
            "compiled": m.compiled,
            "startup_s": m.startup_s,
            "adapters": [a.as_dict() for a in m.adapters()],
            "refused": m.refused,
            "stats": m.stats(),
            "size": accepted_size(m),
        }


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)  # it only awaits replicas
@serve.ingress(api)
class Ingress:
    """HTTP front: validates the body, tags the call with its adapter, retries when a replica dies, counts metrics.
    Admits up to `max_images` images in flight (the replicas' capacity plus a queue); more answer 429."""

    def __init__(self, replicas: DeploymentHandle, max_images: int = 64):
        self.replicas = replicas
        self.max_images = max_images
        self.described: dict[str, Any] | None = None  # one replica's `describe`, asked once
        self.metrics = ServeMetrics()
        self.in_flight = 0
        self.created = int(time.time())
        self.latencies: deque[float] = deque(maxlen=64)  # seconds, of the latest requests

    async def describe(self) -> dict[str, Any]:
        if self.described is None:
            self.described = await self.replicas.describe.remote()
        return self.described

    async def pipeline(self) -> Pipeline:
        """What the replicas' pipeline accepts (every replica runs the same preset)."""
        return Pipeline.from_describe(await self.describe(), self.created)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the median latency of recent requests, at least one."""
        return retry_after_s(self.latencies)

    async def run(self, body: dict[str, Any], adapter: str) -> dict[str, Any]:
        """One image on a replica: its answer, retried when the replica dies; a refusal raises the error its status
        stands for (`statuses.error_of`)."""
        handle = self.replicas.options(multiplexed_model_id=adapter)
        for attempt in range(1, RETRIES + 1):
            try:
                answer = await handle.generate.remote(body)
            except RayActorError as e:
                log.warning("replica died under a request (attempt %d of %d): %s", attempt, RETRIES, e)
                continue
            except Exception as e:  # a fault, not the request's: logged here, a plain message for the client
                log.exception("replica failed on a request")
                raise LoraManagerError(f"the server failed on this request ({type(e).__name__}); it is logged.") from e
            if "error" in answer:
                raise error_of(answer["status"], answer["error"], answer["field"])
            self.metrics.observe_answer(answer["info"], answer.pop("replica_state", None))
            answer["info"]["attempts"] = attempt
            return answer
        raise ReplicasLostError(f"no replica could serve the request in {RETRIES} attempts; retry.")

    async def run_all(self, bodies: list[dict[str, Any]], adapter: str) -> list[dict[str, Any]]:
        """Every body at once, admitted only while at most `max_images` are in flight."""
        if self.in_flight + len(bodies) > self.max_images:
            raise ServerBusyError(f"Busy: {self.in_flight} images in flight (limit {self.max_images}); retry.")
        self.in_flight += len(bodies)
        self.metrics.in_flight.set(self.in_flight)
        try:
            return await asyncio.gather(*(self.run(b, adapter) for b in bodies))
        finally:
            self.in_flight -= len(bodies)
            self.metrics.in_flight.set(self.in_flight)

    def count(self, route: str, adapter: str, outcome: str, t0: float) -> None:
        seconds = time.perf_counter() - t0
        self.metrics.requests.labels(route, adapter, outcome).inc()
        self.metrics.latency.labels(route).observe(seconds)
        self.latencies.append(seconds)

    @api.post("/generate")
    async def generate(self, request: Request):
        t0, label = time.perf_counter(), "-"
        try:
            body = await read_body(request)
            req = check_request(
                body["prompt"], body["adapter"], body["strength"], body["seed"], body["steps"], await self.slots()
            )
            label = await self.adapter_label(req.adapters)
            [answer] = await self.run_all([body], req.adapters[0][0] if req.adapters else "")
        except LoraManagerError as e:
            status = status_of(e)
            self.count("/generate", label, outcome(status), t0)
            headers = {"Retry-After": str(self.retry_after())} if status in RETRY else None
            response = refusal(status, str(e), getattr(e, "field", None))
            response.headers.update(headers or {})
            return response
        self.count("/generate", label, "success", t0)
        return answer

    async def slots(self) -> int:
        return (await self.describe())["slots"]

    async def adapter_label(self, mix) -> str:
        """The metrics label of a request's adapters: ids joined by '+', the base model's id for none, and
        'unknown' for ids not registered (so clients cannot create label values without bound)."""
        pipe = await self.pipeline()
        if not mix:
            return pipe.base_model
        ids = [i for i, _ in mix]
        return "+".join(ids) if all(i in pipe.adapters for i in ids) else "unknown"

    @api.post("/v1/images/generations")
    async def images_generations(self, request: Request):
        """The OpenAI Images API (`openai_api.py`): `data` holds one `b64_json` PNG per image."""
        t0, label = time.perf_counter(), "-"
        try:
            pipe = await self.pipeline()
            req = parse_images_request(await read_json(request), pipe)
            label = await self.adapter_label(req.request.adapters)
            if req.n > self.max_images:
                raise RequestError(f"n must be at most {self.max_images} on this server.", field="n")
            first = req.request.adapters[0][0] if req.request.adapters else ""
            answers = await self.run_all(req.bodies(), first)
        except LoraManagerError as e:
            status = status_of(e)
            self.count("/v1/images/generations", label, outcome(status), t0)
            retry = self.retry_after() if status in RETRY else None
            param = getattr(e, "field", None)  # a fault of the whole body names no parameter, as OpenAI's own API
            return openai_refusal(status, str(e), None if param == "body" else param, retry)
        self.count("/v1/images/generations", label, "success", t0)
        data = [{"b64_json": a["image_png_base64"], "revised_prompt": None} for a in answers]
        return {"created": int(time.time()), "data": data, "output_format": "png", "size": f"{req.width}x{req.height}"}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        """The OpenAI list object: the base model and every adapter (`parent`: the base model)."""
        return models_list(await self.pipeline())

    @api.get("/metrics")
    async def metrics_text(self) -> Response:
        """Prometheus text format; one replica's state is refreshed first, and dead replicas' states are dropped."""
        try:
            self.metrics.observe_state(await self.replicas.state.remote())
            live = await asyncio.to_thread(replica_actors, serve.get_replica_context().app_name)
            self.metrics.replicas.keep(set(live))
        except Exception:  # a scrape still answers with what it has
            log.warning("no replica state for this scrape", exc_info=True)
        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

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
    max_ongoing_requests: int | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    threads: int | None = None,
    max_batch: int = 4,
    dtype: str | None = None,
    max_queued: int = 64,
):
    """The Serve application: `replicas` engines behind the ingress, routed by `routing`. Each replica runs up to
    `max_batch` requests in one pipeline call whatever their adapters, so it accepts that many at once
    (`max_ongoing_requests`, default max(2, max_batch)). `dtype`: as `LoraManager.from_preset` takes it (default: the
    preset's on CUDA, float32 on the CPU). The ingress admits as many images as the replicas run at once plus
    `max_queued`; it refuses more with 429 and `Retry-After`."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    options: dict[str, Any] = {
        "num_replicas": replicas,
        # a full replica is skipped: the router tries the next
        "max_ongoing_requests": max_ongoing_requests or max(2, max_batch),
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
    }
    if routing == "affinity":
        options["request_router_config"] = RequestRouterConfig(request_router_class=AdapterAffinityRouter)
    engines = LoraReplica.options(**options).bind(preset, compile, slots, threads, max_batch, dtype)
    return Ingress.bind(engines, replicas * options["max_ongoing_requests"] + max_queued)


def app_builder(args: dict[str, Any]):
    """For Serve config files (KubeRay `serveConfigV2`): `import_path: lora_manager.serving.ray_app:app_builder`,
    `args` as `build_app`'s keywords."""
    return build_app(**args)


def size_replicas(replicas: int, cpus: float, gpus: float, cpus_per_replica: float | None) -> tuple[float, float]:
    """(num_cpus, num_gpus) per replica on a cluster with `cpus` and `gpus`: the CPUs shared out evenly unless
    `cpus_per_replica` is given, one GPU each where there are GPUs. Raises ValueError, naming what is needed and the
    flag to change, where Ray could never place them (it would wait forever)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}.")
    per_gpu = 1.0 if gpus else 0.0
    if replicas * per_gpu > gpus:
        raise ValueError(f"{replicas} replicas need one GPU each, but Ray sees {gpus:g}: pass --replicas {int(gpus)}.")
    per_cpu = cpus / replicas if cpus_per_replica is None else cpus_per_replica
    if replicas * per_cpu > cpus:
        raise ValueError(
            f"{replicas} replicas x {per_cpu:g} CPUs need {replicas * per_cpu:g} CPUs, but Ray sees {cpus:g}: pass "
            f"--cpus-per-replica {cpus / replicas:g} (or leave it out to share the CPUs evenly), or fewer --replicas."
        )
    return per_cpu, per_gpu


def main(args) -> None:
    """`python -m lora_manager serve`: a local Ray instance (or `--address`), the app on `--host:--port`."""
    ray.init(address=args.address, include_dashboard=False)
    resources = ray.cluster_resources()
    try:
        cpus, gpus = size_replicas(
            args.replicas, resources.get("CPU", 0.0), resources.get("GPU", 0.0), args.cpus_per_replica
        )
    except ValueError as e:
        ray.shutdown()
        raise SystemExit(f"serve: {e}") from e
    print(f"serve: {args.replicas} replicas, {cpus:g} CPUs and {gpus:g} GPUs each", flush=True)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(
        args.preset,
        args.replicas,
        args.routing,
        args.compile,
        args.slots,
        num_gpus=gpus,
        num_cpus=cpus,
        threads=max(1, int(cpus)),
        dtype=args.dtype,
        max_queued=args.max_queued,
    )
    serve.run(app, name="lora-hotswap", route_prefix="/", blocking=True)
