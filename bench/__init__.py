"""Benchmarks (not tests): `make bench` runs `python -m bench`; see bench/README.md."""
