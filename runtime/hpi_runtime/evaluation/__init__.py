"""Quality measurements of a loaded model (perplexity), for tests and benchmarks: serving code never imports it."""
