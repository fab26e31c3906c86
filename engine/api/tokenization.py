"""The worker's vLLM server surface beside the OpenAI routes: ``POST /tokenize``,
``POST /detokenize``, ``GET /version``, ``GET /health`` — vLLM's shapes (core.tokenize_protocol),
so a client written for ``vllm serve`` (``vllm bench serve`` counts prompt tokens through
``/tokenize``) finds the same answers on a reference worker.

``/tokenize`` counts what the completion routes compute: the completion form tokenizes a
prompt as ``/v1/completions`` does, the chat form applies the chat template as
``/v1/chat/completions`` does (both with their defaults), so ``count`` is a turn's
``prompt_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

from fastapi import FastAPI, Request, Response
from pydantic import ValidationError

from agentserving.core.service import (
    ApiError,
    document_models,
    error_responses,
    invalid_body,
    json_object,
)
from agentserving.core.tokenize_protocol import (
    TOKENIZE_BODY,
    TOKENIZE_BODY_MODELS,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    tokenize_request,
)
from agentserving.engine.model.tokenizer import Tokenizer


def version() -> str:
    """The installed agentserving's version (what ``/version`` answers)."""
    try:
        return metadata.version("agentserving")
    except metadata.PackageNotFoundError:
        return "unknown"


def prompt_ids(tokenizer: Tokenizer, req: TokenizeRequest) -> list[int]:
    """The ids ``req`` names. Without special tokens a text's special-token strings still
    become their ids (as in a templated prompt); with them, the ids ``encode`` puts before a
    text come first (the BOS, for a tokenizer that adds one)."""
    if isinstance(req, TokenizeChatRequest):
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        text = tokenizer.render_chat(messages, add_generation_prompt=req.add_generation_prompt)
        if req.continue_final_message:
            text = _open_final(text, messages[-1]["content"])
        if req.add_special_tokens:
            return [*tokenizer.encode(""), *tokenizer.prompt_ids(text)]
        return tokenizer.prompt_ids(text)
    if req.add_special_tokens:
        return tokenizer.encode(req.prompt)
    return tokenizer.prompt_ids(req.prompt)


def _open_final(text: str, content: str) -> str:
    """The template's text cut right after the last message's content (its end-of-turn
    dropped), for the model to go on with it."""
    at = text.rfind(content) if content else -1
    return text[:at + len(content)] if at >= 0 else text


def _in_vocabulary(ids: list[int], vocab_size: int, field: str) -> None:
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise ApiError(400, f"{field}[{i}]: token id {t} is not below the vocabulary size "
                           f"{vocab_size}", param=field, code="token_id_out_of_vocabulary")


def install_tokenization_routes(app: FastAPI, tokenizer: Tokenizer, model_name: str,
                                max_model_len: Callable[[], int],
                                serving: Callable[[], None]) -> None:
    """Add the routes. ``serving()`` raises a 503 ``ApiError`` while the engines cannot serve
    (``/health`` answers it, as vLLM's does for a dead engine; ``/tokenize`` too, as the
    model's context length is known once they are loaded)."""

    def same_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this worker serves "
                           f"`{model_name}`.", param="model", type="not_found_error",
                           code="model_not_found")

    @app.post("/tokenize", tags=["vllm"], response_model=TokenizeResponse,
              openapi_extra=TOKENIZE_BODY, responses=error_responses(400, 404, 413, 503),
              summary="A prompt's (or chat's, templated) token ids, as vLLM's /tokenize.")
    async def tokenize(request: Request) -> TokenizeResponse:
        try:
            req = tokenize_request(json_object(await request.body()))
        except ValidationError as exc:
            raise invalid_body(exc) from exc
        same_model(req.model)
        serving()
        ids = prompt_ids(tokenizer, req)
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len(), tokens=ids,
                                token_strs=tokenizer.token_strs(ids)
                                if req.return_token_strs else None)

    @app.post("/detokenize", tags=["vllm"], responses=error_responses(400, 404, 413),
              summary="The text of token ids, special tokens written out, as vLLM's.")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        same_model(body.model)
        _in_vocabulary(body.tokens, tokenizer.vocab_size, "tokens")
        return DetokenizeResponse(prompt=tokenizer.detokenize(body.tokens))

    document_models(app, *TOKENIZE_BODY_MODELS)

    @app.get("/version", tags=["vllm"], summary="The serving engine's version.")
    async def version_route() -> VersionResponse:
        return VersionResponse(version=version())

    @app.get("/health", tags=["health"], response_class=Response,
             responses={200: {"description": "Empty: the engines serve."},
                        **error_responses(503)},
             summary="vLLM's health probe: 200 with an empty body while the engines serve.")
    async def health() -> Response:
        serving()
        return Response(status_code=200)
