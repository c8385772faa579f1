"""Structured outputs: grammars that constrain decoding (JSON schema, JSON object, regex, choice, EBNF).

`params.py` is the request's side (what it asks for, checked in the frontend), `compiler.py` the engine
core's (compile once per grammar, one matcher per request, the step's token bitmask). xgrammar does the
work: it won on CPU against llguidance (bench/results/structured_outputs.md).
"""
