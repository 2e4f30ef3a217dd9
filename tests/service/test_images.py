"""Images over the API: the official openai SDK sends an image chat (a data URL part) to a served tiny Qwen2.5-VL
checkpoint, and to a tiny Qwen3-VL one, whose answers equal transformers'; bad images are refused with a 400 / 413 naming the part, before
anything is queued."""
from __future__ import annotations


import asyncio
import http.server
import json
import io
import threading

import anthropic
import jsonschema
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

from engine.multimodal.inputs import ImagePatches
from service.config import GatewayConfig
from service.memory_broker import MemoryBus, MemoryWorkerBroker
from service.messages import Heartbeat, RequestMsg, SchemaError, decode, encode, images_from_wire, images_to_wire
from loadtest.vl_checkpoint import (IMAGE, build_vl_checkpoint, data_url, gemma3_vl_config, hf_vl_greedy, image,
                                    qwen3_vl_config)
from tests.service.conftest import (API_KEY, MODEL_NAME, START_TIMEOUT_S, engine_stats, gateway_client, get_text,
                                    local_stack, post_json)

MAX_TOKENS = 10
CHAT_URL = "/v1/chat/completions"
TOKENIZE_URL = "/tokenize"


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vl")
    return str(folder), build_vl_checkpoint(folder)


@pytest.fixture(scope="module")
def vl_stack(vl):
    flags = ("--max-image-bytes", "40000", "--max-image-pixels", "40000", "--max-images-per-request", "2",
             "--allowed-media-domains", "127.0.0.1")
    with local_stack(vl[0], num_workers=1, num_gateways=1, gateway_flags=flags) as stack:
        stack.wait_ready(START_TIMEOUT_S)
        yield stack


def chat(*parts: dict) -> dict:
    return {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": list(parts)}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def look_what(path: str) -> str:
    """The chat template's rendering of "Look: <image> what?" as one user message."""
    return AutoTokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " what?"}]}],
        tokenize=False, add_generation_prompt=True)


def reference_ids(path: str, img: Image.Image, cell: int = 16) -> list[int]:
    """That prompt's ids as transformers' processor makes them: the image's one placeholder token repeated once
    per merged ``cell`` x ``cell`` cell (``img``'s sides multiples of it, so it is not resized)."""
    rows = (img.width // cell) * (img.height // cell)
    return [t for token in AutoTokenizer.from_pretrained(path)(look_what(path)).input_ids
            for t in ([token] * rows if token == IMAGE else [token])]


def transformers_answer(vl, img: Image.Image, cell: int = 16) -> tuple[str, int]:
    """transformers' greedy answer to "Look: <image> what?", and its prompt's tokens."""
    path, model = vl
    expected = hf_vl_greedy(model, path, look_what(path), [img], MAX_TOKENS)
    return (AutoTokenizer.from_pretrained(path).decode(expected, skip_special_tokens=True),
            len(reference_ids(path, img, cell)))


def sdk_chat(url: str, img: Image.Image) -> tuple[str, int]:
    """The served answer to "Look: <img> what?" through the openai SDK, and its prompt's tokens."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    out = client.chat.completions.create(**chat({"type": "text", "text": "Look: "}, image_part(data_url(img)),
                                                {"type": "text", "text": " what?"}))
    return out.choices[0].message.content, out.usage.prompt_tokens


def test_openai_sdk_image_chat_equals_transformers(vl, vl_stack):
    for img in (image(7), image(8, 48, 96)):  # two images, the same text: two answers, each transformers'
        assert sdk_chat(vl_stack.url, img) == transformers_answer(vl, img)


@pytest.mark.slow  # a second stack, ~45 s on two shared cores; tests/engine/test_qwen3_vl.py runs the model fast
def test_openai_sdk_image_chat_equals_transformers_on_qwen3_vl(tmp_path):
    """Qwen3-VL served: 16-pixel patches, DeepStack and interleaved M-RoPE behind the same API."""
    model = build_vl_checkpoint(tmp_path, qwen3_vl_config())
    img = image(7, 128, 160)  # 4 x 5 cells of 32 x 32 pixels: 20 placeholder tokens
    with local_stack(str(tmp_path), num_workers=1, num_gateways=1) as stack:
        stack.wait_ready(START_TIMEOUT_S)
        assert sdk_chat(stack.url, img) == transformers_answer((str(tmp_path), model), img, cell=32)


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server with one PNG at /a.png (the stack's gateway may fetch from 127.0.0.1)."""
    buf = io.BytesIO()
    image(10).save(buf, format="PNG")
    png = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path == "/a.png"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/png" if found else "text/plain")
            self.end_headers()
            self.wfile.write(png if found else b"no")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_allowed_domains_image_url_is_fetched(vl, vl_stack, image_host):
    client = openai.OpenAI(base_url=f"{vl_stack.url}/v1", api_key=API_KEY, max_retries=0)
    out = client.chat.completions.create(**chat({"type": "text", "text": "Look: "},
                                                image_part(f"http://{image_host}/a.png"),
                                                {"type": "text", "text": " what?"}))
    assert (out.choices[0].message.content, out.usage.prompt_tokens) == transformers_answer(vl, image(10))
    for url, message in ((f"http://{image_host}/b.png", "HTTP 404"),
                         (f"http://localhost:{image_host.split(':')[1]}/a.png", "not fetched")):
        code, body = post_json(f"{vl_stack.url}{CHAT_URL}", chat(image_part(url)))
        assert code == 400 and body["error"]["param"] == "messages[0].content[0].image_url"
        assert message in body["error"]["message"]


def test_responses_input_image_and_messages_image_block_equal_transformers(vl, vl_stack):
    img = image(9)
    expected, _ = transformers_answer(vl, img)
    client = openai.OpenAI(base_url=f"{vl_stack.url}/v1", api_key=API_KEY, max_retries=0)
    response = client.responses.create(model=MODEL_NAME, max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Look: "},
                                     {"type": "input_image", "image_url": data_url(img)},
                                     {"type": "input_text", "text": " what?"}]}])
    assert response.output_text == expected
    messages = anthropic.Anthropic(base_url=vl_stack.url, api_key=API_KEY, max_retries=0)
    data = data_url(img).split(",", 1)[1]
    answer = messages.messages.create(model=MODEL_NAME, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": data}},
                                     {"type": "text", "text": " what?"}]}])
    assert answer.content[0].text == expected


@pytest.mark.parametrize("part, status, param, message", [
    (image_part("data:image/png;base64,AAAA"), 400, "messages[0].content[1].image_url", "cannot be decoded"),
    (image_part("data:image/gif;base64,R0lGOD"), 400, "messages[0].content[1].image_url", "unsupported image type"),
    (image_part("https://example.com/cat.png"), 400, "messages[0].content[1].image_url", "not fetched"),
    (image_part(data_url(image(1), "JPEG").replace("image/jpeg", "image/png")), 400,
     "messages[0].content[1].image_url", "its MIME type says PNG"),
    # Noise does not compress: ~100 kB of PNG, over --max-image-bytes 40000.
    (image_part(data_url(image(1, 160, 160))), 413, "messages[0].content[1].image_url", "byte limit"),
    # One colour compresses to nothing: a small file of 300 x 300 pixels, over --max-image-pixels 40000.
    (image_part(data_url(Image.new("RGB", (300, 300), (9, 9, 9)))), 413, "messages[0].content[1].image_url",
     "pixels"),
    ({"type": "input_audio", "input_audio": {}}, 400, "messages[0].content[1]", "only text and image_url parts"),
])
def test_bad_images_are_refused_naming_the_part(vl_stack, part, status, param, message):
    for route in (CHAT_URL, TOKENIZE_URL):  # /tokenize reads a chat's images as the chat does
        code, body = post_json(f"{vl_stack.url}{route}", chat({"type": "text", "text": "Look: "}, part))
        assert code == status, (route, body)
        assert body["error"]["param"] == param and message in body["error"]["message"], route


def test_too_many_images_are_refused(vl_stack):
    url = data_url(image(1))
    for route in (CHAT_URL, TOKENIZE_URL):
        code, body = post_json(f"{vl_stack.url}{route}", chat(*[image_part(url)] * 3))
        assert code == 400 and body["error"]["param"] == "messages", route
        assert "max_images_per_request" in body["error"]["message"], route


async def test_an_image_to_a_text_only_model_is_refused(tokenizer):
    bus = MemoryBus()
    async with gateway_client(GatewayConfig(), tokenizer, bus) as client:
        for route in (CHAT_URL, TOKENIZE_URL):
            response = await client.post(route, json=chat(image_part(data_url(image(1)))))
            body = await response.json()
            assert response.status == 400 and body["error"]["param"] == "messages[0].content[0].image_url", route
            assert "text-only" in body["error"]["message"], route
    assert not any(bus.queued.values())


def test_tokenize_expands_each_image_as_the_chat_does(vl, vl_stack):
    """/tokenize of a chat with images: each placeholder as many tokens as the image has embedding rows, the
    count the chat's usage.prompt_tokens reports; Anthropic's count_tokens counts them too."""
    path, _ = vl
    client = openai.OpenAI(base_url=f"{vl_stack.url}/v1", api_key=API_KEY, max_retries=0)
    for img in (image(3), image(4, 96, 48)):
        body = chat({"type": "text", "text": "Look: "}, image_part(data_url(img)), {"type": "text", "text": " what?"})
        code, tokens = post_json(f"{vl_stack.url}{TOKENIZE_URL}", body)
        assert code == 200 and tokens["tokens"] == reference_ids(path, img), tokens
        used = client.chat.completions.create(**{**body, "max_tokens": 1}).usage.prompt_tokens
        assert tokens["count"] == used == len(tokens["tokens"]) and tokens["tokens"].count(IMAGE) > 1
    messages = anthropic.Anthropic(base_url=vl_stack.url, api_key=API_KEY, max_retries=0)
    counted = messages.messages.count_tokens(model=MODEL_NAME, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Look: "},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": data_url(img).split(",", 1)[1]}},
        {"type": "text", "text": " what?"}]}])
    assert counted.input_tokens == tokens["count"]
    with pytest.raises(anthropic.BadRequestError, match="unsupported image type"):
        messages.messages.count_tokens(model=MODEL_NAME, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": "R0lGODlh"}}]}])


def test_the_sdks_other_image_spellings_are_taken(vl, vl_stack):
    """image_url as the URL alone (as some clients send it), with each detail level (accepted, ignored), and the
    Responses API's input_image with its detail: each answer transformers'."""
    img = image(11)
    expected, prompt_tokens = transformers_answer(vl, img)
    client = openai.OpenAI(base_url=f"{vl_stack.url}/v1", api_key=API_KEY, max_retries=0)
    url = data_url(img)
    for spelling in (url, {"url": url, "detail": "auto"}, {"url": url, "detail": "low"},
                     {"url": url, "detail": "high"}):
        out = client.chat.completions.create(**chat({"type": "text", "text": "Look: "},
                                                    {"type": "image_url", "image_url": spelling},
                                                    {"type": "text", "text": " what?"}))
        assert (out.choices[0].message.content, out.usage.prompt_tokens) == (expected, prompt_tokens), spelling
    response = client.responses.create(model=MODEL_NAME, max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Look: "},
                                     {"type": "input_image", "image_url": url, "detail": "low"},
                                     {"type": "input_text", "text": " what?"}]}])
    assert response.output_text == expected
    code, body = post_json(f"{vl_stack.url}{CHAT_URL}", chat({"type": "image_url",
                                                              "image_url": {"url": url, "detail": "ultra"}}))
    assert code == 400 and body["error"]["param"] == "messages[0].content[0].image_url.detail"


def test_images_round_trip_the_wire_schema():
    patches = [ImagePatches(torch.randn(16, 384), (1, 4, 4)), ImagePatches(torch.randn(8, 384), (1, 2, 4))]
    msg = RequestMsg("r", [1, 2], {}, "g", 0.0, MODEL_NAME, images=images_to_wire(patches))
    back = images_from_wire(decode(RequestMsg, encode(msg)).images)
    assert [b.grid_thw for b in back] == [p.grid_thw for p in patches]
    assert all(torch.equal(b.pixel_values, p.pixel_values) for b, p in zip(back, patches))
    bad = images_to_wire(patches[:1])
    bad[0]["shape"] = [15, 384]
    with pytest.raises(SchemaError, match="float32 bytes"):
        images_from_wire(bad)


def served_schema(stack, path: str) -> jsonschema.Draft202012Validator:
    """The request schema of ``path`` in the stack's own /openapi.json."""
    operation = json.loads(get_text(f"{stack.url}/openapi.json"))["paths"][path]["post"]
    return jsonschema.Draft202012Validator(operation["requestBody"]["content"]["application/json"]["schema"])


def test_the_served_document_takes_the_image_parts_the_gateway_takes(vl_stack, image_host):
    """For each spelling: whether the served document allows it, and what /tokenize answers. What no schema can
    state (the bytes decode) is the one disagreement."""
    png, gif = data_url(image(1)), "data:image/gif;base64,R0lGODlh"
    cases = [(image_part(png), True, 200), ({"type": "image_url", "image_url": png}, True, 200),
             ({"type": "image_url", "image_url": {"url": png, "detail": "low"}}, True, 200),
             ({"type": "image_url", "image_url": {"url": png, "detail": "ultra"}}, False, 400),
             (image_part(f"http://{image_host}/a.png"), True, 200), (image_part("https://example.com/a.png"), False, 400),
             (image_part(gif), False, 400), (image_part(data_url(image(1, 160, 160))), False, 413),
             (image_part("data:image/png;base64,AAAA"), True, 400)]  # valid base64, not a PNG
    tokenize = served_schema(vl_stack, TOKENIZE_URL)
    for part, allowed, status in cases:
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look: "}, part]}]}
        assert tokenize.is_valid(body) == allowed, part
        assert post_json(f"{vl_stack.url}{TOKENIZE_URL}", body)[0] == status, part
    responses = served_schema(vl_stack, "/v1/responses")
    item = {"role": "user", "content": [{"type": "input_text", "text": "Look: "},
                                        {"type": "input_image", "image_url": png, "detail": "high"}]}
    assert responses.is_valid({"input": [item]})
    assert not responses.is_valid({"input": [{**item, "content": [{"type": "input_image", "image_url": gif}]}]})
    messages = served_schema(vl_stack, "/v1/messages/count_tokens")
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png.split(",", 1)[1]}}
    assert messages.is_valid({"messages": [{"role": "user", "content": [block]}]})
    gif_block = {"type": "image", "source": {"type": "base64", "media_type": "image/gif", "data": "R0lGODlh"}}
    assert not messages.is_valid({"messages": [{"role": "user", "content": [gif_block]}]})


async def test_a_gemma3_chat_is_expanded_as_its_processor_does(tmp_path):
    """Gemma 3: the template's <start_of_image> right after "user\\n"; the ids the gateway queues for the engine are
    Gemma3Processor's (the wrap's newlines joined with the template's), its 16 image tokens included."""
    path, img = str(tmp_path), image(2)
    build_vl_checkpoint(path, gemma3_vl_config())
    tokenizer, bus = AutoTokenizer.from_pretrained(path), MemoryBus()
    question = {"type": "text", "text": " what?"}
    config = GatewayConfig(model=path, engine_poll_s=0.05, resume_deadline_s=0.3)
    async with gateway_client(config, tokenizer, bus) as client:
        await MemoryWorkerBroker(bus, "silent", MODEL_NAME, heartbeat_ttl_s=0.2).heartbeat(
            Heartbeat("silent", "1", MODEL_NAME, 2048, engine_stats()))
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.02)
        response = await asyncio.wait_for(client.post(CHAT_URL, json=chat(image_part(data_url(img)), question)), 10)
    assert response.status == 503  # queued, never pulled: the engine stopped beating
    [(_, payload)] = bus.queued[MODEL_NAME]
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, question]}], tokenize=False,
                                         add_generation_prompt=True)
    processor = Gemma3Processor(AutoImageProcessor.from_pretrained(path), tokenizer, image_seq_length=16)
    assert decode(RequestMsg, payload).prompt_token_ids == processor(text=text, images=[img])["input_ids"][0]
