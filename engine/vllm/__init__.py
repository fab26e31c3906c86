"""AgentServing's KV connector for vLLM: LMCache's vLLM v1 connector plus the memory API, the
``chunk_hashes`` return and kvindex reporting (what LMCache-Ascend adds on NPUs, seed 000).

vLLM loads it with ``--kv-transfer-config '{"kv_connector": "AgentServingConnectorV1",
"kv_connector_module_path": "agentserving.engine.vllm.connector", ...}'``. Only
``connector.py`` imports vLLM (through LMCache's connector); the other modules are plain
Python over LMCache and are importable without vLLM.
"""
