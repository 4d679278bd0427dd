"""The OpenAI wire formats as pure functions: request checks, the models list and the error shape (the server that
speaks them is tested in test_ray_serve.py and test_hostile_inputs.py)."""

from __future__ import annotations

import pytest

from lora_manager.errors import RequestError
from lora_manager.serving.openai_api import NotFoundError, Pipeline, error_body, models_list, parse_images_request

PIPE = Pipeline("tiny/model", ("frame", "dots"), 2, 64, 64, 8, False, 1)


def test_models_list_names_the_base_model_as_every_adapters_parent():
    listed = models_list(PIPE)
    assert listed["object"] == "list"
    base, *adapters = listed["data"]
    assert base["id"] == base["root"] == "tiny/model" and base["parent"] is None
    assert [a["id"] for a in adapters] == ["frame", "dots"]
    assert all(a["parent"] == a["root"] == "tiny/model" and a["object"] == "model" for a in adapters)


def test_images_request_makes_one_engine_request_per_image_with_consecutive_seeds():
    body = {"model": "frame", "prompt": "a", "n": 3, "size": "128x64", "seed": 7, "steps": 2, "strength": 0.5}
    req = parse_images_request({**body, "guidance_scale": 3.0, "response_format": "b64_json"}, PIPE)
    bodies = req.bodies()
    assert [b["seed"] for b in bodies] == [7, 8, 9]
    assert all(b["adapter"] == [["frame", 0.5]] and b["steps"] == 2 for b in bodies)
    assert bodies[0]["params"] == {"height": 64, "width": 128, "guidance_scale": 3.0}
    mixed = parse_images_request({"prompt": "a", "adapters": [["frame", 0.8], ["dots", 1.0]]}, PIPE)
    assert mixed.request.adapters == (("frame", 0.8), ("dots", 1.0)) and mixed.model == "tiny/model"
    assert parse_images_request({"prompt": "a", "model": "tiny/model"}, PIPE).request.adapters == ()


@pytest.mark.parametrize(
    "body,param,kind",
    [
        ({"prompt": "a", "model": "nope"}, "model", NotFoundError),
        ({"prompt": "a", "adapters": ["frame", "nope"]}, "adapters", NotFoundError),
        ({"prompt": "a", "adapters": ["frame"], "model": "dots"}, "model", RequestError),
        ({"prompt": "a", "adapters": ["frame", "dots", "frame"]}, "adapters", RequestError),
        ({"prompt": "a", "size": "65x64"}, "size", RequestError),
        ({"prompt": "a", "size": "1024x1024"}, "size", RequestError),
        ({"prompt": "a", "response_format": "url"}, "response_format", RequestError),
        ({"prompt": "a", "n": 11}, "n", RequestError),
        ({"prompt": "a", "n": 2, "seed": 2**32 - 1}, "seed", RequestError),
        ({"prompt": "a", "guidance_scale": float("nan")}, "guidance_scale", RequestError),
        ({"prompt": "a", "quality": "hd"}, "quality", RequestError),
        ({"model": "frame"}, "prompt", RequestError),
    ],
)
def test_images_request_refusals_name_the_param(body, param, kind):
    with pytest.raises(kind) as refused:
        parse_images_request(body, PIPE)
    assert refused.value.field == param and len(str(refused.value)) < 300


def test_a_compiled_pipeline_takes_its_default_size_only():
    fixed = Pipeline("m", (), 1, 64, 64, 8, True)
    assert (parse_images_request({"prompt": "a", "size": "64x64"}, fixed).width) == 64
    with pytest.raises(RequestError, match="64x64"):
        parse_images_request({"prompt": "a", "size": "64x128"}, fixed)


def test_errors_take_openais_shape():
    assert error_body("no", "model", 404) == {
        "error": {"message": "no", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    }
    assert error_body("busy", None, 429)["error"]["type"] == "rate_limit_error"
    assert error_body("fault", None, 500)["error"]["type"] == "server_error"
