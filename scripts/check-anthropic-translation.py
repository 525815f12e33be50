#!/usr/bin/env python3
"""Check the OpenAI answers Sluice makes from Anthropic's with OpenAI's own Python SDK.

The Anthropic fixtures (core/src/openai/anthropic/testdata/) are translated by the unit test
`anthropic_stream_dump_for_the_sdk_check`, which writes its output to a folder when
SLUICE_DUMP_TRANSLATED names one; this script serves each file to an unchanged `openai` client
through a mock transport and fails unless the SDK parses every chunk (also with pydantic's
validation of `ChatCompletionChunk` / `ChatCompletion`), accumulates the tool calls, and raises
the right exception for the errors.

    SLUICE_DUMP_TRANSLATED=/tmp/xlat cargo nextest run -p sluice anthropic_stream_dump
    python3 scripts/check-anthropic-translation.py /tmp/xlat
"""

import json
import pathlib
import sys

import openai

try:  # the HTTP client the installed SDK is built on
    import httpx2 as httpx
except ImportError:
    import httpx
from openai.types.chat import ChatCompletion, ChatCompletionChunk


def client_serving(status, body, content_type):
    def handler(request):
        return httpx.Response(status, content=body, headers={"content-type": content_type})

    return openai.OpenAI(
        api_key="sk-test",
        base_url="http://sluice.test/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )


MESSAGES = [{"role": "user", "content": "Hi"}]


def check_stream(path):
    body = path.read_bytes()
    # Every chunk passes pydantic's validation, not only the SDK's lenient construction.
    for event in body.decode().split("\n\n"):
        data = event.removeprefix("data: ")
        if data and data != "[DONE]" and '"error"' not in data[:10]:
            ChatCompletionChunk.model_validate(json.loads(data))
    client = client_serving(200, body, "text/event-stream")
    if "error" in path.name:
        try:
            for _ in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
                pass
        except openai.APIError as e:
            assert e.body["type"] == "server_error", e.body
            return f"raised {type(e).__name__}: {e.message}"
        raise AssertionError("no error raised")
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    # The SDK's own accumulator (what `client.chat.completions.stream()` builds on).
    with client.chat.completions.stream(model="m", messages=MESSAGES) as stream:
        try:
            final = stream.get_final_completion()
        except openai.LengthFinishReasonError as e:  # the helper's way to say "length"
            final = e.completion
    message = final.choices[0].message
    for call in message.tool_calls or []:
        json.loads(call.function.arguments)
    return (
        f"{len(chunks)} chunks, finish={final.choices[0].finish_reason}, "
        f"tool_calls={[(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]}, "
        f"content={message.content!r:.60}, usage={chunks[-1].usage.model_dump(exclude_none=True)}"
    )


def check_completion(path):
    body = path.read_bytes()
    ChatCompletion.model_validate(json.loads(body))
    client = client_serving(200, body, "application/json")
    c = client.chat.completions.create(model="m", messages=MESSAGES)
    calls = [(t.id, t.function.name, json.loads(t.function.arguments)) for t in c.choices[0].message.tool_calls]
    return f"finish={c.choices[0].finish_reason}, tool_calls={calls}, usage={c.usage.model_dump(exclude_none=True)}"


def check_error(path):
    status = int(path.stem.split("_")[1])
    client = client_serving(status, path.read_bytes(), "application/json")
    try:
        client.chat.completions.create(model="m", messages=MESSAGES)
    except openai.APIStatusError as e:
        assert e.status_code == status
        return f"raised {type(e).__name__} ({e.status_code}): type={e.type} code={e.code} message={e.message!r}"
    raise AssertionError("no error raised")


def main():
    folder = pathlib.Path(sys.argv[1])
    files = sorted(folder.iterdir())
    assert files, f"nothing in {folder}"
    for path in files:
        if path.suffix == ".sse":
            result = check_stream(path)
        elif path.name.startswith("error_"):
            result = check_error(path)
        else:
            result = check_completion(path)
        print(f"ok  {path.name}: {result}")
    print(f"openai {openai.__version__}: all {len(files)} accepted")


if __name__ == "__main__":
    main()
