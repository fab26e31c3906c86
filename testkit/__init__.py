"""Test support, kept out of the product: what the tests, the e2e suites and the benches share
to start real servers on loopback (``servers``), drive the worker (``worker``), build a toy
simulator profile (``sim``) and enter the test-only vLLM env (``vllm_env``).

A distribution of its own (``agentserving-testkit``, installed by ``make setup`` beside the
project), so no image or wheel of AgentServing carries it and no product module can import it
(tests/test_import_contract.py checks the second).
"""
