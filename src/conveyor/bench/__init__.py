"""`conveyor bench serve`: a streaming load client for a running server, like vLLM's."""
