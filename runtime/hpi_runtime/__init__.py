"""hetero-paged-infer runtime: a paged-KV-cache, continuous-batching LLM engine behind an OpenAI API."""

__version__ = "0.1.0"
