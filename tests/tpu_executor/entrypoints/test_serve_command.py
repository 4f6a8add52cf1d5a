"""``tpu-executor serve`` as a process, with one engine and with two replicas behind Ray Serve:
it answers a real client, and SIGTERM drains (stops accepting, lets in-flight requests finish
within the drain timeout, aborts what outlives it, exits cleanly)."""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.common import free_port, ray_session

SERVE_FLAGS = ["--device", "cpu", "--max-model-len", "1024", "--max-num-seqs", "8", "--prefill-buckets", "32",
               "1024", "--decode-buckets", "2", "8", "--decode-context-buckets", "1024",
               "--memory-budget-bytes", str(256 << 20)]


pytestmark = pytest.mark.slow  # server processes, each starting an engine

# uvicorn shuts down, then raises the signal it caught again so the exit status says why.
STOPPED_BY_SIGTERM = (0, -signal.SIGTERM)


@pytest.fixture(params=["one engine", "replicas"])
def start_server(request, checkpoints, tmp_path_factory):
    """Starts ``tpu-executor serve`` (one engine, or two replicas on a simulated Ray cluster)."""
    processes = []
    tmp_path = tmp_path_factory.mktemp("serve")
    with contextlib.ExitStack() as stack:
        replica_flags = []
        if request.param == "replicas":
            cluster = stack.enter_context(ray_session(str(tmp_path_factory.mktemp("ray")),
                                                      cluster_nodes=[{"TPU": 2}]))
            replica_flags = ["--data-parallel-size", "2", "--ray-address", cluster.address]
        yield lambda *extra: start(processes, checkpoints["llama"], tmp_path, *replica_flags, *extra)
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def start(processes, checkpoint, tmp_path, *extra):
    port = free_port()
    process = subprocess.Popen(["tpu-executor", "serve", checkpoint, "--port", str(port),
                                "--served-model-name", "tiny", *SERVE_FLAGS, *extra], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    processes.append(process)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)


class Streamer(threading.Thread):
    """Streams one completion in the background; records its chunks and how it ended."""

    def __init__(self, url: str, body):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.first_chunk = threading.Event()
        self.tokens, self.finish_reasons, self.done, self.error = 0, [], False, None

    def run(self):
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=dict(self.body, stream=True),
                              timeout=120) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        if "error" in data:  # ended in band (the server aborted it)
                            self.error = data["error"]["message"]
                            continue
                        self.finish_reasons += [c["finish_reason"] for c in data["choices"] if c["finish_reason"]]
                        self.first_chunk.set()
        except httpx.HTTPError as err:
            self.error = err
        self.first_chunk.set()


def turned_away(url: str, timeout_s: float = 10):
    """How the first new request within ``timeout_s`` is turned away: "closed" (the
    single-engine server closes its port), or the status code (the replicated one: 404 from
    Serve's proxy, which drops the route within a fraction of a second of the driver's SIGTERM,
    or 503 from the draining ingress). None if every request was taken."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                                timeout=5).status_code
            if status != 200:
                return status
        except httpx.ConnectError:
            return "closed"
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return None


def test_sigterm_lets_in_flight_requests_finish(start_server):
    process, url = start_server("--drain-timeout", "60")
    streamer = Streamer(url, {"model": "tiny", "prompt": "hello", "max_tokens": 1000, "n": 8, "ignore_eos": True})
    streamer.start()
    assert streamer.first_chunk.wait(60)
    process.send_signal(signal.SIGTERM)
    assert turned_away(url) in ("closed", 404, 503)
    streamer.join(120)
    assert streamer.error is None and streamer.done
    assert streamer.finish_reasons == ["length"] * 8
    assert process.wait(60) in STOPPED_BY_SIGTERM


def test_sigterm_aborts_what_outlives_the_drain_timeout(start_server):
    process, url = start_server("--drain-timeout", "0.5")
    streamer = Streamer(url, {"model": "tiny", "prompt": "hello", "max_tokens": 1000, "n": 8, "ignore_eos": True})
    streamer.start()
    assert streamer.first_chunk.wait(60)
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) in STOPPED_BY_SIGTERM
    streamer.join(60)
    assert len(streamer.finish_reasons) < 8  # cut off, not finished
    assert time.monotonic() - started < 30
