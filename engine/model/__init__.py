"""The reference engine's model: loading (``tiny``, SmolLM2, a folder), the runner, tokenizers
and the ``tiny`` model written out as a Hugging Face folder."""
