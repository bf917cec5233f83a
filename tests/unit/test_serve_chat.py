"""Chat templates (``wavepp.serve.chat``): WavePP renders and tokenizes a chat exactly as
transformers' ``apply_chat_template`` does, for Llama-3-style and Qwen3-style templates
(the template in ``chat_template.jinja`` or in ``tokenizer_config.json``), and refuses
what it cannot render with a 400 that says why."""

from __future__ import annotations

import json

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from wavepp.serve.api import ApiError
from wavepp.serve.chat import ChatTemplate

LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                "<tool_call>", "</tool_call>"]  # fmt: skip

# A template in the Llama 3 instruct style, written for this test: the BOS token, a
# system header with a date (a variable a client may set), tools as indented JSON,
# trimmed contents, the assistant header as the generation prompt.
LLAMA_TEMPLATE = """{{- bos_token }}
{%- if date_string is not defined %}
    {%- set date_string = "01 Jan 2026" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You may call these functions:\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('roles are user, assistant and tool') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# A template in the Qwen3 style, written for this test: the last user query found by a
# reversed loop with a namespace, reasoning shown only after it, tool calls as JSON,
# an empty thinking block when thinking is switched off (enable_thinking).
QWEN_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == 'user' and ns.last_query == messages|length - 1 %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content | default('', true) %}
        {%- set reasoning = message.reasoning_content | default('', true) %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content.lstrip('\\n') }}
        {%- for call in message.tool_calls | default([]) %}
            {{- '\\n<tool_call>\\n' + {'name': call.function.name,
                'arguments': call.function.arguments} | tojson + '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
        {{- '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

CHATS = [
    [{"role": "user", "content": "Hello there, what is a KV cache?"}],
    [{"role": "system", "content": "  You answer briefly. "},
     {"role": "user", "content": "Two plus two?"},
     {"role": "assistant", "content": "Four.", "reasoning_content": "2+2=4", "name": None},
     {"role": "user", "content": "Und drei mal drei? Ünïcödé ✓"}],
    [{"role": "user", "content": "Weather in Oslo?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
     {"role": "tool", "content": "{\"temp\": -3}"}],
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather <now>",
                                           "parameters": {"type": "object"}}}]  # fmt: skip


def _tokenizer(special: list[str], bos: str | None) -> Tokenizer:
    """A byte-level tokenizer (every byte a token, no merges) with special tokens, adding
    the BOS token when asked to add special tokens (as Llama 3's does)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])  # fmt: skip
    return tok


def _checkpoint(tmp_path, family: str):
    folder = tmp_path / family
    folder.mkdir()
    if family == "llama":
        tok = _tokenizer(LLAMA_SPECIAL, "<|begin_of_text|>")
        config = {"bos_token": "<|begin_of_text|>",
                  "eos_token": {"content": "<|eot_id|>", "special": True, "__type": "AddedToken"},
                  "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
        (folder / "chat_template.jinja").write_text(LLAMA_TEMPLATE)
    else:
        tok = _tokenizer(QWEN_SPECIAL, None)
        config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                  "tokenizer_class": "PreTrainedTokenizerFast",
                  "chat_template": [{"name": "default", "template": QWEN_TEMPLATE},
                                    {"name": "tool_use", "template": "unused"}]}  # fmt: skip
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, tok


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_wavepp_tokenizes_a_chat_as_transformers_does(tmp_path, family, chat, tools):
    folder, tok = _checkpoint(tmp_path, family)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    messages = CHATS[chat]
    if family == "llama" and any(m["role"] == "tool" for m in messages):
        messages = messages[:2]  # the llama-style template here has no tool calls
    want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                  tokenize=True, return_dict=False)  # fmt: skip
    template = ChatTemplate.from_directory(
        folder, lambda text: tok.encode(text, add_special_tokens=False).ids)  # fmt: skip
    assert template.tokens(messages, tools=tools) == list(want)
    text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                  tokenize=False)  # fmt: skip
    assert template.render(messages, tools=tools) == text
    if family == "llama":
        assert want[0] == tok.token_to_id("<|begin_of_text|>") != want[1]  # one BOS, no more


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_template_variables_and_no_generation_prompt_match_too(tmp_path, family):
    folder, tok = _checkpoint(tmp_path, family)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    extra = {"date_string": "24 Dec 2026"} if family == "llama" else {"enable_thinking": False}
    for generation in (True, False):
        want = hf.apply_chat_template(CHATS[1], add_generation_prompt=generation,
                                      tokenize=False, **extra)  # fmt: skip
        got = ChatTemplate.from_directory(folder, tok.encode).render(
            CHATS[1], add_generation_prompt=generation, extra=extra)  # fmt: skip
        assert got == want


def test_text_parts_are_joined_and_other_parts_refused(tmp_path):
    folder, tok = _checkpoint(tmp_path, "qwen3")
    template = ChatTemplate.from_directory(folder, tok.encode)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]  # fmt: skip
    assert template.render(parts) == template.render([{"role": "user", "content": "a\nb"}])
    with pytest.raises(ApiError, match="'image_url' is not supported"):
        template.render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_a_template_that_refuses_the_chat_is_a_400_naming_why(tmp_path):
    folder, tok = _checkpoint(tmp_path, "llama")
    template = ChatTemplate.from_directory(folder, tok.encode)
    with pytest.raises(ApiError, match="refused the chat: roles are user, assistant and tool"):
        template.render([{"role": "system", "content": "x"}, {"role": "robot", "content": "y"}])
    (folder / "chat_template.jinja").write_text("{{ messages[0].content + 1 }}")
    with pytest.raises(ApiError, match="failed on the chat: TypeError"):
        ChatTemplate.from_directory(folder, tok.encode).render([{"role": "user", "content": "x"}])


def test_the_sandbox_keeps_a_template_from_python_internals(tmp_path):
    folder, tok = _checkpoint(tmp_path, "llama")
    (folder / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ApiError, match="refused the chat"):
        ChatTemplate.from_directory(folder, tok.encode).render([{"role": "user", "content": ""}])
    (folder / "chat_template.jinja").write_text("{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(ApiError, match="refused the chat"):
        ChatTemplate.from_directory(folder, tok.encode).render([])


def test_a_checkpoint_without_a_template_has_none(tmp_path):
    folder, tok = _checkpoint(tmp_path, "llama")
    (folder / "chat_template.jinja").unlink()
    assert ChatTemplate.from_directory(folder, tok.encode) is None
    assert ChatTemplate.from_directory(tmp_path / "missing", tok.encode) is None
