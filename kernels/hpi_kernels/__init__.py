"""hetero-paged-infer kernels: Triton paged attention and weight-only quantized matmul, with references."""

__version__ = "0.1.0"
