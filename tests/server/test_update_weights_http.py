"""POST /update_weights_from_disk (SGLang's endpoint and field): only with
``update_weights_dir``, behind the API key, reading a model directory under that directory only
(``..``, absolute paths and symbolic links leading out refused with a 400, nothing read); after
an update the completions are HF's on the new weights and every response carries its
``weights_version``; a refused update leaves the old weights served."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

from minijax_serve import Engine
from tests import hf_reference
from tests.engine.test_engine import assert_idle_and_clean
from tests.server_util import running_server
from tests.tiny_server import CONFIG, GREEDY

KEY = "secret-key"
NEW = 8


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory, tiny_dir):
    """DIR: the tiny Llama ("a", the server's) and "b" (other weights), a Qwen2 (another
    architecture), a link out, a shard index naming a file out."""
    root = tmp_path_factory.mktemp("weights")
    shutil.copytree(tiny_dir["llama"], root / "a")
    hf_reference.save_tiny_model("llama", root / "b", seed=1)
    shutil.copytree(tiny_dir["qwen2"], root / "qwen2")
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(tiny_dir["llama"], outside / "llama")
    (root / "link_out").symlink_to(outside / "llama", target_is_directory=True)
    shard = root / "shard_out"  # a shard index naming a file outside DIR
    shutil.copytree(tiny_dir["llama"], shard)
    (shard / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": str(outside / "llama" / "model.safetensors")}}))
    gen = root / "gen_out"  # a generation config linked from outside DIR
    shutil.copytree(tiny_dir["llama"], gen)
    (outside / "generation_config.json").write_text("{}")
    (gen / "generation_config.json").unlink(missing_ok=True)
    (gen / "generation_config.json").symlink_to(outside / "generation_config.json")
    bad = root / "bad_index"  # a shard index of the wrong shape
    shutil.copytree(tiny_dir["llama"], bad)
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1, 2]}))
    return root


@pytest.fixture(scope="module")
def server(tiny_server_dir, weights_dir):
    engine = Engine(tiny_server_dir, **CONFIG)
    with running_server(engine, api_key=KEY, update_weights_dir=str(weights_dir)) as running:
        yield running


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=120)


def complete(server, prompts: list[list[int]]) -> dict:
    res = post(server, "/v1/completions", {
        "model": "tiny", "prompt": prompts, "max_tokens": NEW, "logprobs": 0,
        "temperature": 0, **GREEDY["extra_body"]})
    assert res.status_code == 200, res.text
    return res.json()


def tokens(body: dict) -> list[list[int]]:
    return [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]]
            for c in body["choices"]]


def test_update_from_a_directory_under_dir(server, weights_dir, tiny_dir, tiny_prompts):
    prompts = tiny_prompts[:3]
    before = complete(server, prompts)
    assert tokens(before) == hf_reference.greedy(tiny_dir["llama"], prompts, NEW)
    version = before["weights_version"]
    assert post(server, "/update_weights_from_disk", {"model_path": "b"}, key=None
                ).status_code == 401
    res = post(server, "/update_weights_from_disk", {"model_path": "b"})
    assert res.status_code == 200, res.text
    assert res.json()["success"] and res.json()["weights_version"] == version + 1
    after = complete(server, prompts)
    assert tokens(after) == hf_reference.greedy(weights_dir / "b", prompts, NEW)
    assert after["weights_version"] == version + 1
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=120,
                      headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": prompts[0], "max_tokens": 2,
                            "stream": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: {")]
    assert chunks and {c["weights_version"] for c in chunks} == {version + 1}
    server.on_engine(assert_idle_and_clean)


def test_a_stream_in_flight_finishes_on_the_old_weights(server, weights_dir, tiny_prompts):
    """The update waits for the requests it finds running, which go on streaming."""
    assert post(server, "/update_weights_from_disk", {"model_path": "a"}).status_code == 200
    prompt, new = tiny_prompts[4], 64
    version = complete(server, [prompt])["weights_version"]
    answers = []
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=120,
                      headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": prompt, "max_tokens": new, "logprobs": 0,
                            "temperature": 0, "stream": True, **GREEDY["extra_body"]}) as stream:
        lines = stream.iter_lines()
        chunks = [json.loads(next(line for line in lines if line.startswith("data: {"))[6:])]
        update = threading.Thread(target=lambda: answers.append(
            post(server, "/update_weights_from_disk", {"model_path": "b"})))
        update.start()
        chunks += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    update.join(120)
    assert answers[0].status_code == 200 and answers[0].json()["weights_version"] == version + 1
    assert {c["weights_version"] for c in chunks} == {version}
    streamed = [int(t.removeprefix("token_id:")) for c in chunks
                for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == hf_reference.greedy(weights_dir / "a", [prompt], new)[0]
    assert tokens(complete(server, [prompt])) == hf_reference.greedy(weights_dir / "b", [prompt],
                                                                     NEW)
    server.on_engine(assert_idle_and_clean)


@pytest.mark.parametrize("model_path, message", [
    ("../outside", "leads out of the server's --update-weights-dir"),
    ("b/../../", "leads out of the server's --update-weights-dir"),
    ("/etc", "leads out of the server's --update-weights-dir"),
    ("link_out", "leads out of the server's --update-weights-dir"),
    ("shard_out", "model.safetensors leads out of the server's --update-weights-dir"),
    ("gen_out", "generation_config.json leads out of the server's --update-weights-dir"),
    ("bad_index", "cannot read the shard index"),
    ("nowhere", "no such model directory"),
    ("", "must be a non-empty string"),
    (7, "must be a non-empty string"),
    ("qwen2", "params: weight 'embed_tokens' has shape (263, 96)"),  # another architecture
])
def test_refused_and_the_old_weights_served(server, weights_dir, tiny_prompts, model_path,
                                            message):
    prompts = tiny_prompts[:2]
    before = complete(server, prompts)
    res = post(server, "/update_weights_from_disk", {"model_path": model_path})
    assert res.status_code == 400, res.text
    error = res.json()["error"]
    assert error["param"] == "model_path" and message in error["message"], error
    assert str(weights_dir) not in error["message"]  # no server paths in messages
    assert str(weights_dir.resolve()) not in error["message"]
    after = complete(server, prompts)
    assert tokens(after) == tokens(before)
    assert after["weights_version"] == before["weights_version"]
    server.on_engine(assert_idle_and_clean)


def test_no_endpoint_without_the_flag(tiny_server, clean_server):
    res = httpx.post(tiny_server.base_url + "/update_weights_from_disk",
                     json={"model_path": "b"}, timeout=30)
    assert res.status_code == 404


def test_an_update_the_engine_cannot_take_now_is_a_409(server):
    """Asleep (or an update pending): the client may retry later; not its input's fault."""
    server.on_engine(lambda engine: engine.sleep())
    try:
        res = post(server, "/update_weights_from_disk", {"model_path": "b"})
    finally:
        server.on_engine(lambda engine: engine.wake_up())
    assert res.status_code == 409, res.text
    assert "asleep" in res.json()["error"]["message"]
    server.on_engine(lambda engine: engine.check_invariants())
