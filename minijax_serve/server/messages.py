"""OpenAI chat messages -> what a chat template takes (``/v1/chat/completions``, ``/tokenize``)."""

from __future__ import annotations

from typing import Any

from minijax_serve.server.protocol import bad

# message fields of OpenAI's answers that this server never fills: taken when empty
EMPTY_MESSAGE_FIELDS = {"refusal", "tool_calls", "function_call", "audio", "annotations"}


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI messages -> ``{"role", "content"}`` with string content (text parts joined by
    newlines, as vLLM's), and the message's ``name`` when it has one (for templates that use
    it). An assistant message may have null content and the OpenAI fields this server never
    fills (``refusal``, ``tool_calls``, ...) when they are empty: a client that sends back the
    message it was answered with gets no 400."""
    if messages is None:
        raise bad("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of messages", "messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad(f"messages[{i}] must be an object with role and content", "messages")
        unknown = {key for key, value in msg.items() if key not in {"role", "content", "name"}
                   and not (key in EMPTY_MESSAGE_FIELDS and value in (None, [], {}))}
        if unknown:
            raise bad(f"messages[{i}].{sorted(unknown)[0]} is not supported by this server",
                      "messages")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str):
            raise bad(f"messages[{i}].role must be a string", "messages")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                        part.get("text"), str):
                    raise bad(f"messages[{i}].content[{j}]: only text parts are supported",
                              "messages")
                parts.append(part["text"])
            content = "\n".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts",
                      "messages")
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"messages[{i}].name must be a string", "messages")
        out.append({"role": role, "content": content, **({"name": name} if name else {})})
    return out
