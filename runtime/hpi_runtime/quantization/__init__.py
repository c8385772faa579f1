"""Weight-only int8/int4 quantization: the quantized linear, the offline pass that quantizes a loaded model,
the int4 policies and range fitting, and reading pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors)."""
