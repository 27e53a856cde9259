"""Talk to a `vllm serve` running the MoA speculative method, with the `openai` client.

    python examples/openai_client.py --base-url http://127.0.0.1:8000

Sends a completion and a streamed chat request, prints the answers, then reads the server's
Prometheus /metrics and prints the speculative-decoding acceptance.
"""

from __future__ import annotations

import argparse
import re
import urllib.request

from openai import OpenAI


def spec_decode_metrics(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as r:
        text = r.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--prompt", default="def fibonacci(n):\n")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    print(f"model: {model}\n")

    completion = client.completions.create(
        model=model, prompt=args.prompt, max_tokens=args.max_tokens, temperature=0
    )
    print("--- /v1/completions (greedy) ---")
    print(args.prompt + completion.choices[0].text)

    print("--- /v1/chat/completions (streamed, temperature 0.7) ---")
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a Python function that reverses a list."}],
        max_tokens=args.max_tokens,
        temperature=0.7,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print("\n")

    m = spec_decode_metrics(args.base_url)
    drafts = m.get("vllm:spec_decode_num_drafts", 0.0)
    drafted = m.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = m.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    if drafts:
        print(
            f"speculative decoding: {int(drafts)} drafts, {int(accepted)}/{int(drafted)} draft "
            f"tokens accepted ({accepted / drafted:.0%}), mean accepted length "
            f"tau = {1 + accepted / drafts:.2f} tokens per target pass"
        )
    else:
        print("no speculative-decoding metrics: is the server running with the moa method?")


if __name__ == "__main__":
    main()
