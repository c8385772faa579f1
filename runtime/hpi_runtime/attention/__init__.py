"""Paged attention: the per-step metadata, the backend interface, the reference, C++ op and Triton
backends, the factory that picks one by name, and the per-layer module the models hold."""
