"""The worker API process: its HTTP server and client of the engine processes (the OpenAI
request bodies it accepts are in ``agentserving.core.openai_protocol``)."""
