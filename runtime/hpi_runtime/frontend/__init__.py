"""The API server's side of the engine (vLLM v1's frontend): check and build requests (input processor), turn
the core's deltas into text and outputs (output processor, detokenizer), and drive a core in another process
(`AsyncLLM`) or in this thread (`LLMEngine`, for the offline `LLM` and tests)."""
