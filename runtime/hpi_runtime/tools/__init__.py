"""Tool calling: parse a model's tool-call output back into OpenAI `tool_calls`, per model family.

`parsers.py` holds one parser per family (`--tool-call-parser`, vLLM's names): hermes (Hermes, Qwen 2/2.5/3:
`<tool_call>{json}</tool_call>`), llama3_json (Llama 3.1+: a bare JSON object, maybe after `<|python_tag|>`)
and mistral (`[TOOL_CALLS]` then a JSON list, or `name[ARGS]{json}` in newer tokenizers). `stream.py` holds
back streamed text once a tool call may have begun, so `delta.content` never carries tool-call markup.
This runs in the frontend on detokenized text, never inside the engine step.
"""
