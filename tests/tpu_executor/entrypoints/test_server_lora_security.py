"""What a client can reach through the runtime LoRA routes: only adapters inside the adapter
root (symlinks resolved), one answer for every path outside it whatever is there, errors and
``/v1/models`` without server paths, one winner when two loads of a name race; a server that
opens the routes without a root, or without a key beyond loopback, does not start; and on the
replicated server an adapter a replica cannot read fails its requests, not the replica."""
from __future__ import annotations

import asyncio
import os
import shutil
import threading

import httpx
import openai
import pytest

from tests.common import live_server, tiny_engine_options
from tpu_executor import SamplingParams
from tpu_executor.core.lora import LoRARequest
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.engine.protocols import ServedModel
from tpu_executor.entrypoints.openai.config import ServerConfig
from tpu_executor.tools.lora_adapter import write_random_lora_adapter

OUTSIDE_ANSWER = ("The lora adapter 'x' cannot be loaded from lora_path {!r}: runtime loads read adapters only inside "
                  "the server's adapter root (--lora-adapter-root)")


@pytest.fixture(scope="module")
def dirs(checkpoints, tmp_path_factory):
    """(root, outside): the adapter root, with good and bad adapters and symlinks leading out
    of it, and a directory beside it holding another tenant's adapter and a file."""
    root, outside = tmp_path_factory.mktemp("adapter_root"), tmp_path_factory.mktemp("elsewhere")
    base = checkpoints["llama"]
    write_random_lora_adapter(base, str(root / "ok"), rank=4, seed=1)
    write_random_lora_adapter(base, str(root / "big"), rank=16, seed=2)
    (root / "not_object").mkdir()
    (root / "not_object" / "adapter_config.json").write_text('[{"r": 8}]')
    (root / "empty").mkdir()
    write_random_lora_adapter(base, str(outside / "secret"), rank=4, seed=3)
    (outside / "file.txt").write_text("private")
    os.symlink(outside / "secret", root / "link")
    (root / "borrowed").mkdir()  # its own config, another tenant's weights
    shutil.copy(outside / "secret" / "adapter_config.json", root / "borrowed")
    os.symlink(outside / "secret" / "adapter_model.safetensors", root / "borrowed" / "adapter_model.safetensors")
    return root, outside


@pytest.fixture(scope="module")
def served(checkpoints, dirs):
    root, outside = dirs
    engine = LLMEngine.from_options(checkpoints["llama"], enable_lora=True, max_loras=2, max_lora_rank=8,
                                    **tiny_engine_options(device="cpu"))
    with live_server(engine, enable_lora_runtime_updates=True, lora_adapter_root=str(root),
                     lora_modules=(("trusted", str(outside / "secret")),)) as (url, async_engine):
        yield url, async_engine


def load(url, name, path):
    return httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)


def complete(url, model):
    body = {"model": model, "prompt": [5, 17, 33], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_every_path_outside_the_root_gets_one_answer(served, dirs):
    url, _ = served
    root, outside = dirs
    escapes = [str(outside / "secret"), str(outside / "nowhere"), str(outside / "file.txt"), "/etc", "/",
               f"../{outside.name}/secret", f"{root}/../{outside.name}/secret", "link", "link/.", "borrowed", "a\0b"]
    for path in escapes:
        response = load(url, "x", path)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["message"] == OUTSIDE_ANSWER.format(path), path
        assert response.json()["error"]["param"] == "lora_path"
    assert complete(url, "x").status_code == 404
    assert complete(url, "trusted").status_code == 200  # the operator's adapters lie anywhere


def test_adapters_inside_the_root_load_by_relative_or_absolute_path(served, dirs):
    url, _ = served
    root, _ = dirs
    assert load(url, "relative", "ok").status_code == 200
    assert load(url, "absolute", str(root / "ok")).status_code == 200
    assert load(url, "dotted", "empty/../ok").status_code == 200
    texts = [complete(url, name).json()["choices"][0]["text"] for name in ("relative", "absolute", "dotted")]
    assert texts[0] == texts[1] == texts[2]


def test_a_bad_adapter_inside_the_root_is_named_by_the_path_the_client_gave(served, dirs):
    url, _ = served
    root, _ = dirs
    cases = [("big", "LoRA adapter 'big': model.layers.0.mlp.down_proj has rank 16, above max_lora_rank 8"),
             ("not_object", "LoRA adapter 'not_object': adapter_config.json must hold a JSON object, got list"),
             ("empty", "LoRA adapter 'empty' has no adapter_config.json: not a PEFT adapter directory"),
             (str(root / "empty"), f"LoRA adapter {str(root / 'empty')!r} has no adapter_config.json: not a PEFT "
                                   "adapter directory"),
             ("missing", "LoRA adapter 'missing' has no adapter_config.json: not a PEFT adapter directory")]
    for path, message in cases:
        response = load(url, "y", path)
        assert response.status_code == 400, response.text
        assert response.json()["error"] == {"message": message, "type": "invalid_request_error", "param": "lora_path",
                                            "code": 400}
    assert complete(url, "y").status_code == 404


def test_the_model_list_shows_no_server_paths(served, dirs, checkpoints):
    url, _ = served
    assert load(url, "listed", "ok").status_code == 200
    text = httpx.get(url + "/v1/models").text
    for path in (*map(str, dirs), os.path.realpath(dirs[0]), checkpoints["llama"]):
        assert path not in text
    models = openai.OpenAI(base_url=url + "/v1", api_key="none").models.list().data
    assert [m.id for m in models][:2] == ["tiny", "trusted"] and "listed" in [m.id for m in models]
    assert all(m.root == m.id for m in models)


def test_two_loads_of_one_name_at_once_one_wins(served, monkeypatch):
    url, async_engine = served
    entered, release = threading.Event(), threading.Event()
    real_validate, calls = async_engine.validate_lora, []

    def slow_validate(lora):
        calls.append(lora.lora_name)
        if len(calls) == 1:  # the first load holds its check until the second has been answered
            entered.set()
            release.wait(timeout=60)
        real_validate(lora)

    monkeypatch.setattr(async_engine, "validate_lora", slow_validate)
    first = {}
    thread = threading.Thread(target=lambda: first.update(response=load(url, "twin", "ok")))
    thread.start()
    assert entered.wait(timeout=60)
    second = load(url, "twin", "ok")
    release.set()
    thread.join(timeout=60)
    assert second.status_code == 400
    assert second.json()["error"]["message"] == "The lora adapter 'twin' has already been loaded."
    assert second.json()["error"]["param"] == "lora_name"
    assert first["response"].status_code == 200
    assert calls == ["twin"] and complete(url, "twin").status_code == 200
    # A load that fails gives its name back.
    assert load(url, "again", "empty").status_code == 400
    assert load(url, "again", "ok").status_code == 200


@pytest.mark.parametrize("options, message", [
    (dict(enable_lora_runtime_updates=True), "enable_lora_runtime_updates needs lora_adapter_root"),
    (dict(enable_lora_runtime_updates=True, lora_adapter_root="{root}/nowhere"), "is not a directory"),
    (dict(enable_lora_runtime_updates=True, lora_adapter_root="{root}", host="0.0.0.0"),
     "runtime LoRA updates on a non-loopback host (0.0.0.0) need --api-key"),
    (dict(enable_lora_runtime_updates=True, lora_adapter_root="{root}", host="::"),
     "runtime LoRA updates on a non-loopback host (::) need --api-key"),
    (dict(enable_lora_runtime_updates=True, lora_adapter_root="{root}", host="server.example"),
     "non-loopback host (server.example) need --api-key"),
])
def test_a_server_that_would_expose_the_load_route_does_not_start(tmp_path, options, message):
    options = {k: v.format(root=tmp_path) if isinstance(v, str) else v for k, v in options.items()}
    with pytest.raises(ValueError) as err:
        ServerConfig(model_name="m", **options)
    assert message in str(err.value)


def test_the_load_route_may_open_on_loopback_or_with_a_key(tmp_path):
    for host, key in (("127.0.0.1", None), ("localhost", None), ("::1", None), ("0.0.0.0", "k")):
        config = ServerConfig(model_name="m", host=host, api_key=key, enable_lora_runtime_updates=True,
                              lora_adapter_root=str(tmp_path / "." / ""))
        assert config.lora_adapter_root == str(tmp_path)


def test_the_serve_command_refuses_to_start_without_a_key_beyond_loopback(checkpoints, tmp_path, capsys):
    from tpu_executor.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", checkpoints["llama"], "--host", "0.0.0.0", "--enable-lora-runtime-updates",
              "--lora-adapter-root", str(tmp_path)])
    assert exit_.value.code == 2
    assert "runtime LoRA updates on a non-loopback host (0.0.0.0) need --api-key" in capsys.readouterr().err


def test_a_replica_reads_only_the_operators_adapters_and_those_inside_the_root(dirs):
    from tpu_executor.entrypoints.ray_serve.replicas import AdapterUnavailable, ReplicaAdapters

    root, outside = dirs
    checked = []

    class Engine:
        def validate_lora(self, lora):
            checked.append(lora.lora_name)
            if lora.lora_name == "unreadable":
                raise ValueError(f"LoRA adapter {lora.lora_path!r} has no adapter_model.safetensors")

    server = ServerConfig(model_name="m", enable_lora_runtime_updates=True, lora_adapter_root=str(root),
                          lora_modules=(("trusted", str(outside / "secret")),))
    adapters = ReplicaAdapters(server)
    adapters.check(Engine(), LoRARequest("trusted", 1, str(outside / "secret")))
    adapters.check(Engine(), LoRARequest("ok", 2, os.path.realpath(root / "ok")))
    for name, path in (("escaped", str(outside / "file.txt")), ("link", str(root / "link")),
                       ("borrowed", str(root / "borrowed")), ("unreadable", str(root / "ok"))):
        with pytest.raises(AdapterUnavailable) as err:
            adapters.check(Engine(), LoRARequest(name, 3, path))
        assert str(err.value) == f"the LoRA adapter '{name}' cannot be read on the replica serving this request"
    assert checked == ["trusted", "ok", "unreadable"]


def test_an_adapter_a_replica_cannot_read_fails_its_request_not_the_replica(monkeypatch):
    from tpu_executor.entrypoints.ray_serve import replicas

    message = "the LoRA adapter 'x' cannot be read on the replica serving this request"

    class Handle:  # a Serve handle whose replica refuses the adapter
        def options(self, stream):
            return self

        @property
        def generate(self):
            return self

        def remote(self, request):
            async def deltas():
                raise replicas.AdapterUnavailable(message)
                yield

            return deltas()

    async def run():
        pool = replicas.ReplicaPool(Handle(), ServedModel("m", 64, 100), None, "app", 1, 4)
        stream = pool.add_request("r", [5, 6], SamplingParams(max_tokens=2), lora_request=LoRARequest("x", 1, "/p"))
        return pool, [delta async for delta in stream]

    monkeypatch.setattr(replicas, "_board", lambda app_name: None)
    pool, deltas = asyncio.run(run())
    assert [(d.request_id, d.finished, d.error) for d in deltas] == [("r", True, message)]
    assert pool.is_running
