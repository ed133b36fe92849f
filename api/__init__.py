"""crowdchat's HTTP API: OpenAI-compatible chat completions and Prometheus metrics."""
