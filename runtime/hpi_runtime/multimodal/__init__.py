"""Images in requests: the plain data that travels with a request (inputs.py), and the frontend's reading of
image parts (media.py: fetch and decode) and the model's processor (processor.py: pixels and placeholders)."""
