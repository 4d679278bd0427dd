"""ZeroGPU's main process, as a ZeroGPU Space runs it: `python app.py` with no flags under the real `spaces` package
(SPACES_ZERO_GPU=true) over torch's CUDA build, with no GPU. `spaces` patches torch so that `.to("cuda")` makes
placeholders and anything that really initializes CUDA fails; it forks each `spaces.GPU` call into a GPU worker that
its device API schedules. A stand-in device API here answers 200 to the start-up report and 503 to every schedule
request, so the app must start without touching CUDA and answer /generate with `spaces`' own error.

The interpreter comes from LORA_ZEROGPU_PYTHON: `.ci/run` builds that environment from tests/requirements-zerogpu.txt.
In CI (CI set) a missing environment fails the test; elsewhere it is skipped with the reason."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lora_manager import testing

ROOT = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("LORA_ZEROGPU_PYTHON", "")
PROMPT = "a red circle on a blue background"
READY_TIMEOUT_S = 300  # torch's CUDA build imports slower than the CPU one, and spaces packs every tensor at launch

pytestmark = pytest.mark.app


class DeviceApi(http.server.ThreadingHTTPServer):
    """ZeroGPU's device API as a Space sees it when no GPU is free: the start-up report is taken, every schedule
    request refused (503). Remembers the paths it was asked for."""

    def __init__(self):
        self.calls: list[str] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        path = self.path.split("?")[0]
        self.server.calls.append(path)
        self.send_response(200 if path == "/startup-report" else 503)
        self.send_header("content-length", "0")
        self.end_headers()

    do_GET = do_POST

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def device_api() -> Iterator[DeviceApi]:
    server = DeviceApi()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def zerogpu_python() -> str:
    if PYTHON and Path(PYTHON).is_file():
        return PYTHON
    reason = f"no ZeroGPU environment (LORA_ZEROGPU_PYTHON={PYTHON!r}); `bash .ci/run` builds it"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def test_app_starts_on_zerogpu_without_cuda_and_answers_with_spaces_error(device_api, tmp_path):
    from gradio_client import Client

    python = zerogpu_python()
    cuda = subprocess.run([python, "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True)
    assert cuda.stdout.strip() not in ("", "None"), f"{python} has no CUDA build of torch: {cuda.stderr[-500:]}"
    env = {
        **os.environ,
        "SPACES_ZERO_GPU": "true",
        "SPACES_ZERO_DEVICE_API_URL": device_api.url,
        "HF_HUB_OFFLINE": "1",
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HOME": str(tmp_path),
    }
    for name in ("LORA_PRESET", "LORA_COMPILE", "LORA_MAX_BATCH", "LORA_SLOTS", "LORA_DTYPE"):
        env.pop(name, None)  # the app's defaults, as a Space starts it
    with testing.running_app(ROOT / "app.py", [], env, READY_TIMEOUT_S, python=python) as (url, ready):
        assert "preset tiny, compiled: eager" in ready, ready
        assert device_api.calls == ["/startup-report"]  # spaces found the GPU function and reported it at launch
        client = Client(url, verbose=False)
        with pytest.raises(Exception, match="No GPU was available"):
            client.predict(PROMPT, [["stripes", 1.0]], 1.0, 0, 2, api_name="/generate")
        assert "/schedule" in device_api.calls
        assert httpx.get(url, timeout=30).status_code == 200  # still up, and a second request gets the same answer
        with pytest.raises(Exception, match="No GPU was available"):
            client.predict(PROMPT, "", 1.0, 1, 2, api_name="/generate")
