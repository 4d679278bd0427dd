"""Every public edge under hostile and careless input: the Gradio API (queued and direct routes) of `python app.py` and
the HTTP server of `python -m lora_manager serve`. Each refusal names the field, and a normal request afterwards gives
the same bytes as before it."""

from __future__ import annotations

import base64
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lora_manager.request_schema import MAX_BODY_BYTES, MAX_PROMPT_CHARS
from lora_manager.testing import free_port

from helpers import PROMPT, ROOT, running_app
from servers import running_serve

NORMAL = [PROMPT, "frame", 1.0, 0, 2]  # prompt, adapter, strength, seed, steps
MAX_ECHO = 400  # characters: a refusal never echoes a long value whole

# (case, the five /generate values, the field the message must name); every route answers 422 (`HOSTILE_STATUS`)
HOSTILE = [
    ("strength as text", [PROMPT, "frame", "abc", 0, 2], "strength"),
    ("strength None", [PROMPT, "frame", None, 0, 2], "strength"),
    ("strength out of range", [PROMPT, "frame", 5.0, 0, 2], "strength"),
    ("strength a bool", [PROMPT, "frame", True, 0, 2], "strength"),
    ("seed as text", [PROMPT, "frame", 1.0, "x", 2], "seed"),
    ("seed negative", [PROMPT, "frame", 1.0, -1, 2], "seed"),
    ("seed fractional", [PROMPT, "frame", 1.0, 1.5, 2], "seed"),
    ("seed too large", [PROMPT, "frame", 1.0, 2**40, 2], "seed"),
    ("seed None", [PROMPT, "frame", 1.0, None, 2], "seed"),
    ("steps zero", [PROMPT, "frame", 1.0, 0, 0], "steps"),
    ("steps as text", [PROMPT, "frame", 1.0, 0, "ten"], "steps"),
    ("steps too many", [PROMPT, "frame", 1.0, 0, 1000], "steps"),
    ("steps fractional", [PROMPT, "frame", 1.0, 0, 2.5], "steps"),
    ("prompt None", [None, "frame", 1.0, 0, 2], "prompt"),
    ("prompt too long", ["a" * (MAX_PROMPT_CHARS + 1), "frame", 1.0, 0, 2], "prompt"),
    ("prompt of 3 MB", ["a" * 3_000_000, "frame", 1.0, 0, 2], "prompt"),
    ("adapter the number 0", [PROMPT, 0, 1.0, 0, 2], "adapter"),
    ("adapter an empty object", [PROMPT, {}, 1.0, 0, 2], "adapter"),
    ("adapter [5]", [PROMPT, [5], 1.0, 0, 2], "adapter"),
    ("adapter [{}]", [PROMPT, [{}], 1.0, 0, 2], "adapter"),
    ("adapter [[]]", [PROMPT, [[]], 1.0, 0, 2], "adapter"),
    ("adapter [null]", [PROMPT, [None], 1.0, 0, 2], "adapter"),
    ("adapter id of 100 KB", [PROMPT, "x" * 100_000, 1.0, 0, 2], "adapter"),
    ("adapter unknown", [PROMPT, "nope", 1.0, 0, 2], "adapter"),
    ("adapter strength as text", [PROMPT, [["frame", "1"]], 1.0, 0, 2], "strength"),
    ("adapter strength out of range", [PROMPT, [["frame", 9]], 1.0, 0, 2], "strength"),
    ("adapter twice", [PROMPT, [["frame", 1.0], ["frame", 0.5]], 1.0, 0, 2], "twice"),
    ("more adapters than slots", [PROMPT, ["frame", "dots", "pixel"], 1.0, 0, 2], "slot"),
    ("a flood of adapter entries", [PROMPT, [""] * 10_000, 1.0, 0, 2], "adapter"),
]
HOSTILE_STATUS = {"adapter unknown": 404}  # the cases whose status is not 422, the same on every route


def _digest_png(data: bytes) -> str:
    from io import BytesIO

    from PIL import Image

    return hashlib.sha256(Image.open(BytesIO(data)).convert("RGB").tobytes()).hexdigest()


# ---- the Gradio app -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app_url():
    with running_app() as url:
        yield url.rstrip("/")


def direct(url: str, data: list, api_name: str = "generate") -> httpx.Response:
    """Gradio's direct route: no queue, no concurrency limit."""
    return httpx.post(f"{url}/gradio_api/run/{api_name}", json={"data": data}, timeout=300)


def normal_digest(url: str) -> str:
    r = direct(url, NORMAL)
    assert r.status_code == 200, r.text
    return _digest_png(httpx.get(r.json()["data"][0]["url"], timeout=60).content)


@pytest.fixture(scope="module")
def baseline(app_url) -> str:
    return normal_digest(app_url)


def queued(url: str, data: list, api_name: str = "generate") -> str:
    """Gradio's queued route as a plain HTTP client uses it: POST the call, read its event stream; the error text."""
    r = httpx.post(f"{url}/gradio_api/call/{api_name}", json={"data": data}, timeout=60)
    assert r.status_code == 200, r.text
    stream = httpx.get(f"{url}/gradio_api/call/{api_name}/{r.json()['event_id']}", timeout=300).text
    assert "event: error" in stream, stream[:500]
    return stream.split("event: error", 1)[1].split("data:", 1)[1].strip()


@pytest.mark.app
@pytest.mark.parametrize("case,data,field", HOSTILE, ids=[c for c, _, _ in HOSTILE])
def test_gradio_refuses_naming_the_field(app_url, baseline, case, data, field):
    r = direct(app_url, data)
    status = HOSTILE_STATUS.get(case, 422)
    assert r.status_code == status and field in r.json()["error"], r.text[:500]  # a refusal, not a server error
    assert len(r.json()["error"]) < MAX_ECHO
    message = queued(app_url, data)
    assert field in message and len(message) < MAX_ECHO, message[:500]
    assert normal_digest(app_url) == baseline


@pytest.mark.app
def test_gradio_lone_surrogate_and_nan_as_raw_json(app_url, baseline):
    for text, field in [
        ('{"data": ["a\\ud800", "frame", 1.0, 0, 2]}', "prompt"),
        ('{"data": ["a", "frame", NaN, 0, 2]}', "strength"),
        ('{"data": ["a", "frame", 1.0, 0, Infinity]}', "steps"),
    ]:
        r = httpx.post(
            f"{app_url}/gradio_api/run/generate", content=text, headers={"content-type": "application/json"}, timeout=60
        )
        assert r.status_code == 422 and field in r.json()["error"], r.text[:300]
    assert normal_digest(app_url) == baseline


@pytest.mark.app
@pytest.mark.parametrize(
    "body,field,routes",
    [
        ('{"data": NaN}', "body.data", ("run", "call")),
        ('{"data": ["a", "frame", 1.0, 0, 2], "session_hash": NaN}', "body.session_hash", ("run", "call")),
        ('{"data": ["a", "frame", 1.0, 0, 2], "trigger_id": Infinity}', "body.trigger_id", ("run",)),
        ('{"data": ["a", "frame", 1.0, 0, 2], "fn_index": -Infinity}', "body.fn_index", ("run",)),
    ],
)
def test_gradio_non_finite_numbers_in_the_body_are_refused_with_a_message(app_url, baseline, body, field, routes):
    """Gradio's request models refuse these fields (the queued route reads only some of them); the refusal names the
    field without echoing the value (a NaN cannot be written back as JSON), on the direct and the queued route."""
    for route in routes:
        r = httpx.post(
            f"{app_url}/gradio_api/{route}/generate", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 422, (route, r.status_code, r.text[:300])
        message = r.json()["error"]
        assert field in message and "finite" in message and len(message) < MAX_ECHO, message
        assert "Traceback" not in r.text and str(ROOT) not in r.text
    assert normal_digest(app_url) == baseline


@pytest.mark.app
def test_gradio_wrong_input_counts_and_internal_events_answer_with_a_message(app_url, baseline):
    for n in (3, 1, 0):  # too few values: refused with the counts, the values not echoed
        r = direct(app_url, NORMAL[:n])
        assert r.status_code == 422 and f"needed: 5, got: {n}" in r.json()["error"], r.text[:300]
        assert PROMPT not in r.json()["error"] and len(r.json()["error"]) < MAX_ECHO
    config = httpx.get(f"{app_url}/config", timeout=60).json()
    internal = [d["id"] for d in config["dependencies"] if d.get("api_visibility") != "public"]
    public = {d["api_name"] for d in config["dependencies"] if d.get("api_visibility") == "public"}
    assert public == {"generate", "add_adapter", "strategies"}, public
    for fn_index in internal:
        for data in ([None] * 12, ["x"] * 12, [{"a": 1}] * 12):
            r = httpx.post(f"{app_url}/gradio_api/run/predict", json={"data": data, "fn_index": fn_index}, timeout=60)
            assert r.status_code in (200, 422, 500) and (r.status_code == 200 or r.json().get("error")), r.text[:300]
    assert normal_digest(app_url) == baseline


@pytest.mark.app
def test_gradio_add_adapter_refuses_long_or_odd_values_briefly(app_url, baseline):
    for repo_id, weight_name in [("a/" + "b" * 100_000, ""), (5, ""), ("../etc/passwd", ""), ("a/b", "c" * 5000)]:
        r = direct(app_url, [repo_id, weight_name], "add_adapter")
        text = r.json().get("error") or json.dumps(r.json().get("data"))
        assert len(text) < MAX_ECHO and ("Refused" in text or "must be" in text), text[:500]
    assert normal_digest(app_url) == baseline


@pytest.mark.app
def test_gradio_upload_route_takes_nothing_big(app_url):
    r = httpx.post(f"{app_url}/gradio_api/upload", files={"files": ("big.bin", b"x" * 2_000_000)}, timeout=60)
    assert r.status_code == 413


@pytest.mark.app
def test_gradio_concurrent_calls_to_every_endpoint(app_url, baseline):
    """Generate, add_adapter and three benchmark runs at once on the direct route: one measurement runs, the others
    are refused at once as busy (429, saying when to retry); nothing breaks, and a later measurement works."""
    calls = [("strategies", [2])] * 3 + [("generate", NORMAL)] * 3 + [("add_adapter", ["nobody/x" * 3, ""])]
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(lambda c: direct(app_url, c[1], c[0]), calls))
    bench = answers[:3]
    assert sum(r.status_code == 200 for r in bench) == 1, [r.text[:200] for r in bench]
    refused = [r for r in bench if r.status_code != 200]
    assert all(r.status_code == 429 and "already running; retry" in r.json()["error"] for r in refused), [
        (r.status_code, r.text[:200]) for r in refused
    ]
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert all(r.status_code == 200 for r in answers[3:6])
    digests = {_digest_png(httpx.get(r.json()["data"][0]["url"], timeout=60).content) for r in answers[3:6]}
    assert digests == {baseline}
    assert direct(app_url, [2], "strategies").status_code == 200


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.app
def test_app_memory_flat_over_200_requests_with_the_largest_prompt():
    with running_app("--slots", "1") as url:
        url = url.rstrip("/")
        pid = _app_pid(url)
        longest = ("a red circle on a blue background " * 100)[:MAX_PROMPT_CHARS]
        for _ in range(20):  # warm: allocator pools, the tokenizer's caches
            assert direct(url, [longest, "frame", 1.0, 0, 1]).status_code == 200
        before = _rss(pid)
        for i in range(200):
            prompt = longest if i % 2 else PROMPT
            assert direct(url, [prompt, ["", "frame", "dots"][i % 3], 1.0, i, 1]).status_code == 200
        grown = _rss(pid) / before - 1
        assert grown < 0.10, f"resident memory grew {grown:.1%} over 200 requests"


def _app_pid(url: str) -> int:
    """The `python app.py --port N` process serving `url`."""
    port = url.rsplit(":", 1)[1]
    for entry in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if entry.isdigit() and any(a.endswith(b"app.py") for a in argv) and port.encode() in argv:
            return int(entry)
    raise LookupError(f"no app.py process on port {port}")


# ---- the Ray Serve HTTP server --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python -m lora_manager serve` with one replica and two slots on a free port, admitting 6 images at once (4 the
    replica runs, 2 queued)."""
    pytest.importorskip("ray")
    port = free_port()
    args = ["--replicas", "1", "--slots", "2", "--port", str(port), "--max-queued", "2"]
    with running_serve(args, port, tmp_path_factory.mktemp("serve") / "serve.log") as url:
        yield url


def post(url: str, body) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
    return httpx.post(f"{url}/generate", timeout=300, headers={"content-type": "application/json"}, **kwargs)


def http_digest(url: str) -> str:
    r = post(url, dict(zip(("prompt", "adapter", "strength", "seed", "steps"), NORMAL, strict=True)))
    assert r.status_code == 200, r.text
    return _digest_png(base64.b64decode(r.json()["image_png_base64"]))


@pytest.fixture(scope="module")
def http_baseline(server) -> str:
    return http_digest(server)


def assert_refused(r: httpx.Response, status: int, field: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error", "field"} and len(body["error"]) < MAX_ECHO, body
    assert field in body["error"] or body["field"] == field, body
    assert "Traceback" not in r.text and "\x1b[" not in r.text and str(ROOT) not in r.text


@pytest.mark.ray
def test_http_refuses_every_hostile_value_naming_the_field(server, http_baseline):
    for case, data, field in HOSTILE:
        body = dict(zip(("prompt", "adapter", "strength", "seed", "steps"), data, strict=True))
        r = post(server, body)
        too_big = len(r.request.content) > MAX_BODY_BYTES  # refused before it is parsed
        assert_refused(r, 413 if too_big else HOSTILE_STATUS.get(case, 422), "body" if too_big else field)
    assert http_digest(server) == http_baseline


@pytest.mark.ray
@pytest.mark.parametrize(
    "case,body,status,field",
    [
        ("not JSON", "{prompt: nope", 422, "body"),
        ("a JSON array", "[1, 2]", 422, "body"),
        ("an unknown field", json.dumps({"prompt": PROMPT, "cfg": 9}), 422, "cfg"),
        ("no prompt", json.dumps({"adapter": "frame"}), 422, "prompt"),
        ("a lone surrogate", '{"prompt": "a\\ud800"}', 422, "prompt"),
        ("NaN strength", '{"prompt": "a", "strength": NaN}', 422, "strength"),
        ("infinite seed", '{"prompt": "a", "seed": Infinity}', 422, "seed"),
        ("a 20 MB body", json.dumps({"prompt": "a" * 20_000_000}), 413, "body"),
        ("not UTF-8", b'{"prompt": "\xff\xfe"}', 422, "body"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None,
)
def test_http_refuses_malformed_bodies(server, http_baseline, case, body, status, field):
    assert_refused(post(server, body), status, field)


@pytest.mark.ray
def test_http_info_names_models_as_users_know_them(server, http_baseline):
    r = post(server, {"prompt": PROMPT, "adapter": [["frame", 0.5], ["dots", 1.0]]})
    assert r.status_code == 200 and r.json()["info"]["base_model"] == "tiny/model"
    info = httpx.get(f"{server}/info", timeout=60).text
    assert str(ROOT) not in info and str(ROOT) not in r.text
    with ThreadPoolExecutor(6) as pool:  # concurrent valid and hostile requests: each gets its own answer
        answers = list(
            pool.map(lambda b: post(server, b), [{"prompt": PROMPT, "adapter": "frame", "steps": 2}, {"prompt": 5}] * 3)
        )
    assert [a.status_code for a in answers] == [200, 422] * 3
    assert http_digest(server) == http_baseline


# ---- the OpenAI routes of the same server ---------------------------------------------------------------------------

IMAGES = {"model": "frame", "prompt": PROMPT, "steps": 2}  # NORMAL as an OpenAI Images API request
HUGE = 3_000_000  # characters: over MAX_BODY_BYTES

# (case, the request body (a raw string is sent as is), the status, the param the error must name)
OPENAI_HOSTILE = [
    ("unknown model", {**IMAGES, "model": "nope"}, 404, "model"),
    ("model id of 100 KB", {**IMAGES, "model": "x" * 60_000}, 404, "model"),
    ("model a number", {**IMAGES, "model": 5}, 422, "model"),
    ("unknown adapter in adapters", {**IMAGES, "model": None, "adapters": ["frame", "nope"]}, 404, "adapters"),
    ("adapters beside another model", {**IMAGES, "adapters": ["dots"]}, 422, "model"),
    ("more adapters than slots", {**IMAGES, "model": None, "adapters": ["frame", "dots", "pixel"]}, 422, "adapters"),
    ("adapters an object", {**IMAGES, "model": None, "adapters": {"frame": 1}}, 422, "adapters"),
    ("size not WxH", {**IMAGES, "size": "big"}, 422, "size"),
    ("size not a multiple", {**IMAGES, "size": "65x64"}, 422, "size"),
    ("size too large", {**IMAGES, "size": "4096x4096"}, 422, "size"),
    ("size a number", {**IMAGES, "size": 64}, 422, "size"),
    ("response_format url", {**IMAGES, "response_format": "url"}, 422, "response_format"),
    ("output_format webp", {**IMAGES, "output_format": "webp"}, 422, "output_format"),
    ("n zero", {**IMAGES, "n": 0}, 422, "n"),
    ("n eleven", {**IMAGES, "n": 11}, 422, "n"),
    ("n as text", {**IMAGES, "n": "2"}, 422, "n"),
    ("n past the seeds", {**IMAGES, "n": 2, "seed": 2**32 - 1}, 422, "seed"),
    ("seed negative", {**IMAGES, "seed": -1}, 422, "seed"),
    ("steps too many", {**IMAGES, "steps": 1000}, 422, "steps"),
    ("strength as text", {**IMAGES, "strength": "abc"}, 422, "strength"),
    ("guidance_scale NaN", '{"model": "frame", "prompt": "a", "guidance_scale": NaN}', 422, "guidance_scale"),
    ("guidance_scale huge", {**IMAGES, "guidance_scale": 1e9}, 422, "guidance_scale"),
    ("an unsupported field", {**IMAGES, "quality": "hd"}, 422, "quality"),
    ("no prompt", {"model": "frame"}, 422, "prompt"),
    ("prompt a list", {**IMAGES, "prompt": ["a"]}, 422, "prompt"),
    ("prompt of 3 MB", {**IMAGES, "prompt": "a" * HUGE}, 413, None),
    ("not JSON", "{model: frame", 422, None),
    ("a JSON array", "[1, 2]", 422, None),
]


def images(url: str, body) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}/v1/images/generations", timeout=300, headers=headers, **kwargs)


def images_digest(url: str) -> str:
    r = images(url, IMAGES)
    assert r.status_code == 200, r.text[:500]
    return _digest_png(base64.b64decode(r.json()["data"][0]["b64_json"]))


@pytest.mark.ray
@pytest.mark.parametrize("case,body,status,param", OPENAI_HOSTILE, ids=[c for c, *_ in OPENAI_HOSTILE])
def test_openai_route_refuses_naming_the_param(server, http_baseline, case, body, status, param):
    r = images(server, body)
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}, r.text[:500]
    assert error["param"] == param and len(error["message"]) < MAX_ECHO, error
    assert "Traceback" not in r.text and str(ROOT) not in r.text
    assert images_digest(server) == http_baseline  # the same request on /generate: the same pixels


@pytest.mark.ray
def test_openai_route_answers_429_with_retry_after_past_the_queue(server, http_baseline):
    """Two requests for 4 images at once against a limit of 6 in flight: one runs, the other is refused at once and
    the OpenAI client raises its RateLimitError; a later request runs as before."""
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)

    def call(_):
        try:
            return client.images.generate(model="frame", prompt=PROMPT, n=4, extra_body={"steps": 2})
        except openai.RateLimitError as e:
            return e

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(call, range(2)))
    refused = [a for a in answers if isinstance(a, openai.RateLimitError)]
    assert len(refused) == 1, answers
    assert int(refused[0].response.headers["retry-after"]) >= 1 and refused[0].body["param"] is None
    assert images_digest(server) == http_baseline
