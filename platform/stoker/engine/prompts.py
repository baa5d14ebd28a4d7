"""A request's prompt as token ids, and the tokens it may generate: what the engine checks before
a request takes a slot. The chat template is the model's own (transformers' `apply_chat_template`),
given the request's tools where the template takes them (`stoker.engine.tools`); every refusal is a
400 naming the field, as vLLM answers it."""

from __future__ import annotations

import jinja2

from stoker.engine import tools
from stoker.engine.protocol import GenerationRequest, SamplingParams
from stoker.errors import invalid


def prompt_ids(tokenizer, req: GenerationRequest) -> list[int]:
    """The prompt's token ids, at least one, each in the vocabulary: transformers' generation
    loop dies on an empty prompt (a zero-length forward) and takes every request with it."""
    if req.messages is not None:
        ids, param = _chat_prompt(tokenizer, req), "messages"
    elif isinstance(req.prompt, tuple):
        ids, param = list(req.prompt), "prompt"
    else:  # as vLLM: special tokens added, so a tokenizer with a BOS serves "" as [BOS]
        ids, param = tokenizer.encode(req.prompt, add_special_tokens=True), "prompt"
    if not ids:
        raise invalid(
            f"The prompt cannot be empty: '{param}' encodes to no tokens, and a completion needs at "
            "least one.",
            param=param,
        )
    vocab = len(tokenizer)
    if max(ids) >= vocab:
        raise invalid(f"'{param}' has a token id outside the vocabulary (size {vocab}).", param=param)
    return ids


def _chat_prompt(tokenizer, req: GenerationRequest) -> list[int]:
    """The chat template applied; a template that fails on this conversation (a role or a
    message order it does not take) is a 400, as vLLM answers it."""
    template = getattr(tokenizer, "chat_template", None)
    with_tools = isinstance(template, str) and "tools" in template
    messages = tools.template_messages(req.messages, req.tools, with_tools)
    extra = {"tools": req.tools.for_template()} if req.tools is not None and with_tools else {}
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
        )
    except jinja2.TemplateError as exc:
        raise invalid(
            f"The model's chat template refused these messages: {str(exc)[:300]}", param="messages"
        ) from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def budget(max_model_len: int, prompt_tokens: int, params: SamplingParams) -> int:
    """How many tokens this request may generate; refuses requests that cannot fit the context,
    or whose `min_tokens` cannot fit it."""
    room = max_model_len - prompt_tokens
    if params.max_tokens is None:
        if room < 1:
            raise invalid(
                f"This model's maximum context length is {max_model_len} tokens; "
                f"the prompt has {prompt_tokens}.",
                param="messages",
                code="context_length_exceeded",
            )
        if params.min_tokens > room:
            raise invalid(
                f"'min_tokens' ({params.min_tokens}) exceeds the {room} tokens the context leaves "
                f"after the prompt ({prompt_tokens} tokens).",
                param="min_tokens",
            )
        return room
    if params.max_tokens > room:
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + params.max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{params.max_tokens} for the completion).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return params.max_tokens
