"""One training record (a JSON object or a table row) in any layout users have, read into one of
three shapes: a chat, a prompt/response pair, or text.

Layouts, tried in this order (a key whose value is null counts as absent: a table row carries
every column of its file):
- `messages`: [{"role", "content"}, ...] as the chat template takes them, passed on unchanged
  (UltraChat-200k's rows add `prompt` and `prompt_id`, which are ignored).
- `conversations`: ShareGPT turns [{"from", "value"}, ...] (EAGLE's, SpecForge's and most
  speculative-decoding training sets) or [{"role", "content"}, ...]; role names mapped by
  `SHAREGPT_ROLES`.
- `data`: UltraChat's [user, assistant, user, assistant, ...] strings.
- `prompt`/`response`, `question`/`answer` (GSM8K), `prompt`/`completion`.
- `text`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ShareGPT's speaker names (lower-cased) -> the chat template's roles.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}
PAIR_KEYS = (("prompt", "response"), ("question", "answer"), ("prompt", "completion"))


@dataclass(frozen=True)
class Chat:
    messages: list[dict[str, Any]]  # [{"role", "content"}, ...]: loss on the assistant turns


@dataclass(frozen=True)
class Pair:
    prompt: str
    response: str  # loss on the response and EOS


@dataclass(frozen=True)
class Text:
    text: str  # loss on every token


Record = Chat | Pair | Text


def parse_record(record: Any, where: str) -> Record:
    """`record` in any of the layouts above; `where` ("file.jsonl:3", "file.parquet row 2") names
    it in errors."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    given = {k for k, v in record.items() if v is not None}
    if "messages" in given:
        return Chat(_messages(record["messages"], where))
    if "conversations" in given:
        return Chat(_sharegpt(record["conversations"], where))
    if isinstance(record.get("data"), list):
        return Chat(_ultrachat(record["data"], where))
    for p_key, r_key in PAIR_KEYS:
        if p_key in given and r_key in given:
            return Pair(str(record[p_key]), str(record[r_key]))
    if "text" in given:
        return Text(str(record["text"]))
    raise ValueError(
        f"{where}: record with keys {sorted(record)[:6]} has no `messages`, `prompt`/`response`, "
        "`question`/`answer`, `text`, `conversations` (ShareGPT) or `data` (UltraChat); "
        "see docs/training.md for the accepted layouts"
    )


def _messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"{where}: `messages` must be a list of {{role, content}} objects")
    return messages


def _sharegpt(turns: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(turns, list):
        raise ValueError(f"{where}: `conversations` must be a list of turns, got {turns!r:.80}")
    out = []
    for j, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from") is not None:
            role, content = turn["from"], turn.get("value")
        elif isinstance(turn, dict) and turn.get("role") is not None:
            role, content = turn["role"], turn.get("content")
        else:
            raise ValueError(
                f"{where}: `conversations` turn {j} needs `from`/`value` or `role`/`content`, "
                f"got {turn!r:.80}"
            )
        mapped = SHAREGPT_ROLES.get(str(role).lower())
        if mapped is None:
            raise ValueError(
                f"{where}: `conversations` turn {j} has unknown role {role!r}; known: "
                "human/user (user), gpt/assistant/chatgpt/bing/bard (assistant), system. "
                "Rename it in the data, or write the record as `messages` with `role`/`content` "
                "(passed to the chat template unchanged)"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"{where}: `conversations` turn {j} ({role!r}) needs a string `value`/`content`, "
                f"got {type(content).__name__}"
            )
        out.append({"role": mapped, "content": content})
    return out


def _ultrachat(data: list[Any], where: str) -> list[dict[str, Any]]:
    for j, text in enumerate(data):
        if not isinstance(text, str):
            raise ValueError(
                f"{where}: `data` (UltraChat: alternating user and assistant strings) holds "
                f"{type(text).__name__} at position {j}; every item must be a string"
            )
    return [{"role": ("user", "assistant")[j % 2], "content": t} for j, t in enumerate(data)]
