"""`vlens serve`: vLLM's OpenAI-compatible server with per-request steering and activations."""
