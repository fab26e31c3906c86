"""schemathesis hooks for the OpenAI APIs (loaded through ``SCHEMATHESIS_HOOKS``).

A worker answers some schema-valid completions with a 400 whose code names a limit of its
model that no JSON schema can carry: ``context_length_exceeded`` (a prompt's length in tokens
is only known once it is tokenized) and, behind the proxy, whose schema cannot know the
model's vocabulary, ``token_id_out_of_vocabulary``. Both 400s are documented. This check is
schemathesis' ``positive_data_acceptance`` with exactly the codes listed in
``FUZZ_RUNTIME_LIMIT_CODES`` allowed; the fuzz tests run it instead of the built-in check.
"""

from __future__ import annotations

import os

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance


@schemathesis.check
def positive_data_acceptance_within_model_limits(ctx, response, case):  # type: ignore[no-untyped-def]
    allowed = set(filter(None, os.environ.get("FUZZ_RUNTIME_LIMIT_CODES", "").split(",")))
    if response.status_code == 400:
        try:
            code = response.json()["error"].get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            code = None
        if code in allowed:
            return None
    return positive_data_acceptance(ctx, response, case)
