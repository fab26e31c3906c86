"""The worker API process: its HTTP server, wire protocol and client of the engine processes."""
