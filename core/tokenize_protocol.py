"""The tokenizer routes a vLLM server has beside the OpenAI ones — ``/tokenize`` and
``/detokenize`` — with vLLM's request and response shapes, so that vLLM's own clients
(``vllm bench serve`` probes ``/tokenize`` to count prompt tokens) work against a reference
worker and through the proxy as they do against ``vllm serve``.

A tokenize request has two forms, told apart as vLLM tells them: a body with ``messages`` is
the chat form (the chat template applied, as ``/v1/chat/completions`` applies it), any other
the completion form (``prompt`` tokenized as ``/v1/completions`` tokenizes it). Unknown fields
are ignored (vLLM's also take ``tools``, ``chat_template_kwargs`` and more); types are strict,
as in ``openai_protocol``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from agentserving.core.openai_protocol import ChatMessage, TokenId


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TokenizeCompletionRequest(_Body):
    """Tokenize ``prompt`` as a completion's prompt (a body with ``messages`` is the chat
    form, whatever else it holds: the schema says so, keeping the two forms apart)."""

    model_config = ConfigDict(json_schema_extra={"not": {"required": ["messages"]}})

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(
        True, description="Add the tokenizer's special tokens (BOS) as a completion does.")
    return_token_strs: bool | None = Field(
        False, description="Also answer each token's string (`token_strs`).")


class TokenizeChatRequest(_Body):
    """Tokenize ``messages`` as a chat completion's prompt: the chat template applied."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(
        True, description="End with the assistant's turn opening, as a chat completion does.")
    continue_final_message: bool = Field(
        False, description="Leave the last message open, for the model to continue it.")
    add_special_tokens: bool = Field(
        False, description="Add special tokens besides the template's (it writes its own).")
    return_token_strs: bool | None = Field(
        False, description="Also answer each token's string (`token_strs`).")

    # continue_final_message: true needs add_generation_prompt: false, given (it defaults
    # to true); the validator below says so in a 400, this in the schema
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"continue_final_message": {"const": True}},
               "required": ["continue_final_message"]},
        "then": {"properties": {"add_generation_prompt": {"const": False}},
                 "required": ["add_generation_prompt"]}})

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("cannot be true together with add_generation_prompt (set "
                             "add_generation_prompt to false)")
        return v


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def tokenize_request(body: dict[str, Any]) -> TokenizeRequest:
    """The form ``body`` is (chat when it has ``messages``), validated; raises pydantic's
    ``ValidationError`` naming the field."""
    form = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    return form.model_validate(body)


class TokenizeResponse(BaseModel):
    count: int = Field(description="How many tokens: `len(tokens)`.")
    max_model_len: int = Field(description="The model's context length, in tokens.")
    tokens: list[int]
    token_strs: list[str] | None = Field(
        None, description="Each token's string, with `return_token_strs`.")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId] = Field(description="Token ids to turn back into text.")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="The text of the tokens, special tokens written out.")


class VersionResponse(BaseModel):
    version: str = Field(description="The serving engine's version.")


# The OpenAPI of ``POST /tokenize``: its body is one of two models (see tokenize_request).
TOKENIZE_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"oneOf": [
        {"$ref": "#/components/schemas/TokenizeCompletionRequest"},
        {"$ref": "#/components/schemas/TokenizeChatRequest"}]}}}}}
TOKENIZE_BODY_MODELS = (TokenizeCompletionRequest, TokenizeChatRequest)
