"""Chat prompts (``POST /v1/chat/completions``): the body, and a checkpoint's chat
template, rendered as Hugging Face renders it.

The template comes from the tokenizer files: ``chat_template.jinja``, else the
``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates:
``tool_use`` for a chat with tools when there is one, else ``default``). It is rendered
in jinja2's immutable sandbox with the environment and the variables transformers'
``apply_chat_template`` gives it — trimmed blocks, ``tojson`` without HTML escaping,
``raise_exception``, ``strftime_now``, ``namespace``, ``{% generation %}`` blocks; the
messages with their ``None`` fields dropped and their reasoning under every name
templates read; the special tokens (``bos_token``, ``eos_token``, ...) of the tokenizer's
config — and the text is tokenized without adding special tokens (the template places
them), so that WavePP and ``transformers`` give the same token ids for the same chat. A
message's content is a string or a list of text parts (joined by newlines, as vLLM does
for string templates).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment

from wavepp.runtime.handoff import BandServers
from wavepp.serve.api import (
    NEUTRAL,
    OpenAIBody,
    Submission,
    check_id,
    decode_body,
    openai_handoff,
    token_array,
)
from wavepp.serve.errors import ApiError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # fmt: skip
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MAX_TEMPLATE_CHARS = 1 << 20

Encode = Callable[[str], list[int]]  # text -> token ids, no special tokens added


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's
    tokens with it; rendering, it is its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` refusing underscore names (no way to CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's own signature trick
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template stored {name!r} on a "
                                                  "namespace")  # fmt: skip


class _Dict:
    """``dict`` in a template: a call and ``fromkeys``, no way to the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_Namespace, dict=_Dict(),
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))  # fmt: skip
    return env


def _token_text(value: Any) -> str | None:
    """A special token as a tokenizer config writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _templates_of(config: dict) -> dict[str, str]:
    """The named templates of a tokenizer config (one string: ``default``)."""
    source = config.get("chat_template")
    if isinstance(source, str):
        return {"default": source}
    if isinstance(source, list):
        return {t["name"]: t["template"] for t in source if isinstance(t, dict)
                and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


class ChatTemplate:
    """A model's chat template with its special tokens and its tokenizer (``encode``)."""

    def __init__(self, sources: Mapping[str, str], special_tokens: Mapping[str, str],
                 encode: Encode) -> None:  # fmt: skip
        """``sources``: the templates by name (``default``; ``tool_use``, for chats with
        tools)."""
        if "default" not in sources and "tool_use" not in sources:
            raise ValueError(f"no default chat template among {sorted(sources)}")
        if any(len(text) > MAX_TEMPLATE_CHARS for text in sources.values()):
            raise ValueError(f"a chat template is over {MAX_TEMPLATE_CHARS:,} characters")
        env = _environment()
        self._templates = {name: env.from_string(text) for name, text in sources.items()}
        self.special_tokens = dict(special_tokens)
        self._encode = encode

    @classmethod
    def from_directory(cls, directory: Path, encode: Encode) -> ChatTemplate | None:
        """The template of a checkpoint's tokenizer files, or None when it has none."""
        config = _read_json(directory / "tokenizer_config.json")
        jinja_file = directory / "chat_template.jinja"
        sources = ({"default": jinja_file.read_text()} if jinja_file.is_file()
                   else _templates_of(config))  # fmt: skip
        if "default" not in sources and "tool_use" not in sources:
            return None
        named = _read_json(directory / "special_tokens_map.json")
        special = {}
        for name in SPECIAL_TOKENS:
            text = _token_text(config.get(name))
            text = text if text is not None else _token_text(named.get(name))
            if text is not None:
                special[name] = text
        return cls(sources, special, encode)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Any] | None = None, documents: Sequence[Any] | None = None,
               extra: Mapping[str, Any] | None = None) -> str:  # fmt: skip
        """The chat as text. ``extra``: more template variables (``chat_template_kwargs``);
        they override the special tokens, as in transformers. ApiError(400) when the
        template refuses the chat."""
        variables = {**self.special_tokens, **(extra or {})}
        name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
        template = self._templates.get(name) or self._templates["tool_use"]
        try:
            return template.render(
                messages=[_normalized(m) for m in messages], tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **variables)  # fmt: skip
        except jinja2.exceptions.TemplateError as error:
            raise ApiError(400, f"the model's chat template refused the chat: {error}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as error:
            raise ApiError(400, f"the model's chat template failed on the chat: "
                           f"{type(error).__name__}: {error}") from None  # fmt: skip

    def tokens(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int]:
        """The chat's token ids (:meth:`render`, tokenized without added special tokens)."""
        return self._encode(self.render(messages, **options))


def _normalized(message: Mapping[str, Any]) -> dict:
    """A message as transformers hands it to a template: keys whose value is None left
    out, a list of text parts as one string, reasoning under every name templates read."""
    out = {k: v for k, v in message.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = _text_of(content)
    reasoning = next((out[k] for k in REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _text_of(parts: list) -> str:
    texts = []
    for part in parts:
        if not (isinstance(part, Mapping) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):  # fmt: skip
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ApiError(400, f"message content part of type {kind!r} is not supported: "
                           "WavePP prefills text (parts of type 'text')")  # fmt: skip
        texts.append(part["text"])
    return "\n".join(texts)


MAX_MESSAGES = 1 << 14


class ChatBody(OpenAIBody, kw_only=True):
    """``POST /v1/chat/completions``: the fields it shares with completions
    (``wavepp.serve.api.OpenAIBody``), its messages and the template's inputs."""

    messages: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1,
                                                           max_length=MAX_MESSAGES)]  # fmt: skip
    # the template's inputs, as transformers' apply_chat_template takes them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # what a prefill cannot do (CHAT_NEUTRAL): refused unless neutral, or the decoder's
    top_logprobs: Any = None
    response_format: Any = None


CHAT_NEUTRAL = {**{k: v for k, v in NEUTRAL.items() if k not in ("best_of", "suffix", "echo")},
                "logprobs": (None, False), "top_logprobs": (None, 0),
                "response_format": (None, {"type": "text"})}  # fmt: skip
"""Chat fields a prefill server does not do, and the values that ask nothing of it."""


def parse_chat(raw: bytes, template: ChatTemplate | None, no_template: str,
               decode: str | None = None,
               servers: BandServers | None = None) -> tuple[Submission, ChatBody]:  # fmt: skip
    """A chat request as the engine's submission: its messages through the model's
    template (``template``; None: ApiError(400) saying ``no_template``), the rest as
    :func:`wavepp.serve.api.parse_completion` reads a completion's."""
    body: ChatBody = decode_body(raw, ChatBody)
    for i, message in enumerate(body.messages):
        if not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] has no role (a string)")
    if body.continue_final_message:
        raise ApiError(400, "continue_final_message is not supported: the prompt ends with "
                       "the generation prompt (add_generation_prompt)")  # fmt: skip
    handoff, ignored = openai_handoff(body, CHAT_NEUTRAL, decode, servers)
    if template is None:
        raise ApiError(400, no_template)
    tokens = template.tokens(body.messages, add_generation_prompt=body.add_generation_prompt,
                             tools=body.tools, documents=body.documents,
                             extra=body.chat_template_kwargs)  # fmt: skip
    if not tokens:
        raise ApiError(400, "empty prompt: the chat template rendered no tokens")
    return Submission(token_array(tokens), check_id(body.request_id), body.priority, handoff,
                      body.deadline_s, ignored), body  # fmt: skip
