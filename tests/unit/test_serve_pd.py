"""vLLM's P/D protocol on the server (``wavepp.serve.pd``), over a stand-in engine: the
proxy's shape of request to P — completions and chat — is answered in the OpenAI shape
with the ``kv_transfer_params`` D pulls with; what P cannot serve is a 400 naming the
field; request ids follow X-Request-Id."""

from __future__ import annotations

import re

import anyio
import httpx
import pytest

from tests.helpers.fake_engine import FakeEngine, expected_first_token
from wavepp.serve.app import ServeOptions, build_app
from wavepp.serve.chat import ChatTemplate
from wavepp.serve.pd import decoder_params

pytestmark = pytest.mark.anyio
VOCAB = 1000
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
CHAT = ChatTemplate({"default": TEMPLATE}, {"bos_token": "^"},
                    lambda text: [ord(c) % VOCAB for c in text])  # fmt: skip
OPTIONS = ServeOptions(model_name="tiny", tokenize=lambda t: [ord(c) % VOCAB for c in t],
                       detokenize=lambda t: f"<{t}>", chat=CHAT)  # fmt: skip
# what vLLM's toy proxy sends P (BRIEF §6)
PROXY_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
HEADERS = {"X-Request-Id": "5f0c-proxy-uuid", "Authorization": "Bearer None"}


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _with_server(test, options: ServeOptions = OPTIONS, **engine_args):
    engine = FakeEngine(vocab_size=VOCAB, **engine_args)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, options)),
                               base_url="http://wavepp")  # fmt: skip
    async with client, anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        try:
            await test(engine, client)
        finally:
            engine.drain()


def proxied(body: dict) -> dict:
    """The client's body as the proxy sends it to P."""
    return {**body, "kv_transfer_params": PROXY_PARAMS, "stream": False, "max_tokens": 1}


async def test_a_proxied_completion_answers_the_params_d_pulls_with():
    async def test(engine, client):
        prompt = list(range(3, 40))
        body = proxied({"model": "tiny", "prompt": prompt, "temperature": 0.7, "top_p": 0.9,
                        "seed": 7, "stop": ["\n"], "logprobs": 2, "n": 2, "user": "u"})
        reply = await client.post("/v1/completions", json=body, headers=HEADERS)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["id"] == "cmpl-5f0c-proxy-uuid" and answer["object"] == "text_completion"
        first = expected_first_token(prompt, VOCAB)
        choice = answer["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["logprobs"]) == (
            f"<{first}>", "length", None)
        assert answer["usage"]["prompt_tokens"] == 37 and answer["usage"]["completion_tokens"] == 1
        params = answer["kv_transfer_params"]
        assert set(params) == {"do_remote_prefill", "do_remote_decode", "prompt_token_ids",
                               "remote_prefill_cached_tokens", "wavepp"}
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["prompt_token_ids"] == prompt and params["remote_prefill_cached_tokens"] == 0
        wavepp = params["wavepp"]
        assert wavepp["request_id"] == "5f0c-proxy-uuid"  # X-Request-Id: valid and free
        assert wavepp["stages"] == list(engine.band_servers.addresses)
        assert (wavepp["version"], wavepp["num_tokens"], wavepp["first_token"]) == (1, 37, first)
        assert 0 < wavepp["expires_in_s"] <= 30.0
        assert set(answer["wavepp"]["ignored"]) == {"temperature", "top_p", "stop", "logprobs",
                                                   "seed", "n"}
        # the same X-Request-Id again: in use, so WavePP names the request; the answer's
        # id still echoes the header
        again = (await client.post("/v1/completions", json=body, headers=HEADERS)).json()
        assert again["id"] == "cmpl-5f0c-proxy-uuid"
        assert again["kv_transfer_params"]["wavepp"]["request_id"] != "5f0c-proxy-uuid"
        assert again["kv_transfer_params"]["remote_prefill_cached_tokens"] == 32

    await _with_server(test)


async def test_a_proxied_chat_answers_in_the_chat_shape():
    async def test(engine, client):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        body = proxied({"model": "tiny", "messages": messages, "max_completion_tokens": 1,
                        "stream_options": {"include_usage": True}})
        body.pop("max_tokens")
        reply = await client.post("/v1/chat/completions", json=body, headers=HEADERS)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["id"] == "chatcmpl-5f0c-proxy-uuid"
        assert answer["object"] == "chat.completion"
        prompt = CHAT.tokens(messages)
        first = expected_first_token(prompt, VOCAB)
        assert answer["choices"][0]["message"] == {"role": "assistant", "content": f"<{first}>"}
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["kv_transfer_params"]["prompt_token_ids"] == prompt
        assert prompt[0] == ord("^") and prompt[-len("<assistant>"):] == [ord(c) for c in
                                                                         "<assistant>"]
        assert answer["wavepp"]["ignored"] == ["stream_options"]

    await _with_server(test)


@pytest.mark.parametrize(("params", "extra", "match"), [
    ({**PROXY_PARAMS, "remote_hots": "x"}, {}, "unknown field `remote_hots`"),
    ({**PROXY_PARAMS, "do_remote_decode": "yes"},
     {}, r"Expected `bool`, got `str` - at `\$.kv_transfer_params.do_remote_decode`"),
    ({**PROXY_PARAMS, "remote_port": 70000}, {}, r"kv_transfer_params.remote_port"),
    ({**PROXY_PARAMS, "remote_block_ids": ["a"]}, {}, r"kv_transfer_params.remote_block_ids"),
    ({"do_remote_prefill": True}, {}, "do_remote_prefill: true asks this server to load"),
    ("yes", {}, r"at `\$.kv_transfer_params`"),
    (PROXY_PARAMS, {"stream": True}, "stream must be false"),
    (PROXY_PARAMS, {"max_tokens": 16}, "max_tokens must be 1"),
    (PROXY_PARAMS, {"max_completion_tokens": 4}, "max_completion_tokens must be 1"),
])  # fmt: skip
async def test_params_p_cannot_serve_are_a_400_naming_the_field(params, extra, match):
    async def test(engine, client):
        for route, body in (("/v1/completions", {"prompt": [1, 2, 3]}),
                            ("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "x"}]})):  # fmt: skip
            sent = {**body, "max_tokens": 1, "kv_transfer_params": params, **extra}
            reply = await client.post(route, json=sent, headers=HEADERS)
            assert reply.status_code == 400, (route, reply.text)
            assert re.search(match, reply.json()["error"]["message"]), reply.text
        assert not engine.requests

    await _with_server(test)


async def test_without_band_servers_or_a_template_the_400_says_so():
    async def test(engine, client):
        engine.band_servers = None
        reply = await client.post("/v1/completions", json=proxied({"prompt": [1, 2]}))
        assert reply.status_code == 400
        assert "serve no bands to decoders" in reply.json()["error"]["message"]

    await _with_server(test)

    async def no_template(engine, client):
        chat = {"messages": [{"role": "user", "content": "x"}]}
        reply = await client.post("/v1/chat/completions", json=chat)
        assert reply.status_code == 400
        assert reply.json()["error"]["message"] == "the model has none, say"

    await _with_server(no_template, ServeOptions(no_chat="the model has none, say"))


async def test_without_remote_decode_chat_behaves_as_completions_do():
    async def test(engine, client):
        chat = {"messages": [{"role": "user", "content": "hello"}]}
        plain = (await client.post("/v1/chat/completions", json=chat)).json()
        prompt = CHAT.tokens(chat["messages"])
        assert plain["choices"][0]["token_ids"] == [expected_first_token(prompt, VOCAB)]
        assert "kv_transfer_params" not in plain
        for field, value, status in (("temperature", 0.7, 400), ("max_tokens", 5, 400),
                                     ("stream", True, 400), ("logprobs", True, 400),
                                     ("seed", 3, 200), ("temperature", 0, 200),
                                     ("logprobs", False, 200)):  # fmt: skip
            reply = await client.post("/v1/chat/completions", json={**chat, field: value})
            assert reply.status_code == status, (field, value, reply.text)
        off = {**chat, "kv_transfer_params": {**PROXY_PARAMS, "do_remote_decode": False}}
        assert "kv_transfer_params" not in (await client.post("/v1/chat/completions",
                                                              json=off)).json()  # fmt: skip
        bad = await client.post("/v1/chat/completions", json={"messages": [{"content": "x"}]})
        assert bad.status_code == 400 and "messages[0] has no role" in bad.text

    await _with_server(test)


async def test_x_request_id_names_prefills_too_unless_invalid():
    async def test(engine, client):
        named = await client.post("/v1/prefill", json={"tokens": [1, 2, 3]},
                                  headers={"X-Request-Id": "abc-1"})  # fmt: skip
        assert named.json()["id"] == "abc-1"
        body_id = await client.post("/v1/prefill", json={"tokens": [1, 2], "id": "mine"},
                                    headers={"X-Request-Id": "abc-2"})  # fmt: skip
        assert body_id.json()["id"] == "mine"
        invalid = await client.post("/v1/prefill", json={"tokens": [1, 2]},
                                    headers={"X-Request-Id": "a/b"})  # fmt: skip
        assert invalid.status_code == 200 and invalid.json()["id"] not in ("a/b", "abc-1")
        pulled = await client.post("/v1/prefill", json={"tokens": [4, 5], "handoff": "pull:"})
        params = pulled.json()["kv_transfer_params"]
        assert params["wavepp"]["request_id"] == pulled.json()["id"]
        assert pulled.json()["handoff"]["status"] == "held"

    await _with_server(test)


def test_decoder_params_only_for_a_held_cache():
    from wavepp.engine import Result
    from wavepp.runtime.handoff import BandServers

    servers = BandServers(("unix:/a-stage0.sock", "tcp://10.0.0.5:7301"), 30.0)
    held = Result("r", "done", 42, 1.0, 3, 0, None, 0.0, 0.0, 0.0, 10.0,
                  handoff={"status": "held", "held_since": 100.0})  # fmt: skip
    assert decoder_params(held, [1, 2, 3], servers, now=104.0) == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_prefill_cached_tokens": 0,
        "prompt_token_ids": [1, 2, 3],
        "wavepp": {"version": 1, "request_id": "r", "stages": list(servers.addresses),
                   "num_tokens": 3, "first_token": 42, "expires_in_s": 26.0}}  # fmt: skip
    failed = Result("r", "done", 42, 1.0, 3, 0, None, 0.0, 0.0, 0.0, 10.0,
                    handoff={"status": "failed"})  # fmt: skip
    assert decoder_params(failed, [1, 2, 3], servers) is None
