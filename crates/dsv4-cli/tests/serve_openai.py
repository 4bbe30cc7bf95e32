"""Drives `dsv4 serve` with the official openai client: python3 serve_openai.py BASE_URL MODEL."""
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused")

assert [m.id for m in client.models.list().data] == [model]

r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
)
assert r.choices[0].message.role == "assistant"
assert r.choices[0].finish_reason in ("stop", "length")
assert r.usage.completion_tokens <= 8
whole = r.choices[0].message.content

chunks = list(
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
)
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert text == whole, (text, whole)
assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens

c = client.completions.create(model=model, prompt="Once", max_tokens=5, temperature=1.0, seed=7)
d = client.completions.create(model=model, prompt="Once", max_tokens=5, temperature=1.0, seed=7)
assert c.choices[0].text == d.choices[0].text

t = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Think"}],
    max_tokens=6,
    temperature=0,
    extra_body={"chat_template_kwargs": {"thinking": True}},
)
assert isinstance(t.choices[0].message.model_extra.get("reasoning_content"), str)

try:
    client.completions.create(model=model, prompt="x", max_tokens=-1)
    raise AssertionError("a negative max_tokens was accepted")
except openai.BadRequestError as e:
    assert "max_tokens" in str(e)

print("all openai client checks passed")
