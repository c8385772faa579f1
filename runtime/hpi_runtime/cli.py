"""`hpi`: the runtime's command line (`hpi serve`; the router is its own package, `hpi-router`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
from collections.abc import Mapping

from hpi_runtime.models.registry import SUPPORTED_ARCHITECTURES  # imports no torch: --help stays fast

SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
API_KEY_ENV = "HPI_API_KEY"


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5G', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1000000)")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpi", description="hetero-paged-infer runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        description="Serve a Hugging Face model directory over an OpenAI-compatible HTTP API with a paged KV "
        "cache and continuous batching. Without --model, serves the embedded SmolLM2-135M-Instruct on CPU. "
        f"Supported architectures (config.json's 'architectures'): {', '.join(SUPPORTED_ARCHITECTURES)}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = serve.add_argument_group("model")
    model.add_argument("--model", default=None,
                       help="model directory (config.json, *.safetensors, tokenizer); default: the embedded model")
    model.add_argument("--served-model-name", default=None,
                       help="the name clients put in 'model'; default: the model directory's name")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weight and activation dtype; auto = bf16 where the device does it fast, else fp32")
    model.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="auto = cuda when a GPU is visible, else cpu")
    model.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                       help="auto = the Triton kernels on cuda, the torch reference on cpu")
    model.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                       help="weight-only quantization of the linear layers at load time (int8 per channel, "
                       "int4 group-wise); embeddings and LM head stay in --dtype")
    model.add_argument("--quantization-group-size", type=int, default=32, choices=[32, 64, 128],
                       help="int4 only: weights per scale/zero along K (must divide every layer's K)")
    model.add_argument("--int4-fit", default="mse", choices=["mse", "minmax"],
                       help="int4 only: choose each group's scale/zero by a data-free error-minimising search "
                       "(mse) or by the group's min/max")
    model.add_argument("--int4-policy", default="mixed", choices=["mixed", "uniform"],
                       help="int4 only: mixed keeps the q/k/v projections at int8 (the layers int4 hurts most, "
                       "docs/quantization.md); uniform makes every linear int4")
    model.add_argument("--quantize-lm-head", action="store_true",
                       help="also quantize an untied LM head (a tied one shares the float embedding); "
                       "saves its memory at some cost in logit precision")
    model.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                       help="split the model over this many worker processes (one per GPU on cuda, gloo on "
                       "cpu); attention is split by KV-head groups, see docs/tensor-parallelism.md")
    model.add_argument("--enforce-eager", action="store_true",
                       help="run the model step eagerly: skip torch.compile (its start-up compile and warm-up; "
                       "on CPU the compiled step is faster once running)")
    engine = serve.add_argument_group("engine")
    engine.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                        help="bytes for the paged KV cache per tensor-parallel rank, e.g. 2GiB; default: 1GiB "
                        "on cpu, 85%% of what the weights leave free on cuda")
    engine.add_argument("--kv-offload-bytes", type=parse_bytes, default=0,
                        help="bytes of host memory per tensor-parallel rank for a second KV tier, e.g. 4GiB: "
                        "prefix blocks evicted from the KV cache are kept there and loaded back instead of "
                        "recomputed, and preempted requests are swapped there (docs/kv-offload.md); default 0: off")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch at most")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens computed per engine step at most (chunked-prefill budget)")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + completion tokens per request at most; default: the model's context")
    engine.add_argument("--max-num-waiting", type=int, default=1024,
                        help="queued requests at most; more get HTTP 429")
    engine.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    engine.add_argument("--kv-admission-watermark", type=float, default=0.02,
                        help="fraction of KV blocks a newly admitted request must leave free for the running "
                        "ones to grow into; 0 admits until the pool is full, at the cost of more preemptions")
    engine.add_argument("--seed", type=int, default=0, help="seed for requests that do not set one")
    http = serve.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    http.add_argument("--port", type=int, default=8000, help="port to bind")
    # Read from the environment only when serving: a default would print the secret in --help.
    http.add_argument("--api-key", default=None,
                      help=f"require 'Authorization: Bearer <key>' on /v1/* (env {API_KEY_ENV})")
    http.add_argument("--max-request-body", type=parse_bytes, default=4 * 2**20,
                      help="larger request bodies get HTTP 413")
    http.add_argument("--drain-timeout", type=float, default=30.0,
                      help="seconds to let in-flight requests finish after SIGTERM")
    http.add_argument("--allowed-origins", default=None,
                      help="CORS: comma-separated origins browsers may call from, or '*'; default: no CORS headers")
    openai_api = serve.add_argument_group("openai api")
    openai_api.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                            help="parse the model's tool calls (tool_choice 'auto') in this family's format: hermes "
                            "for Hermes/Qwen, llama3_json for Llama 3.1+, mistral for Mistral; 'required' and a "
                            "named function work without it (the grammar enforces them)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--api-key, else $HPI_API_KEY; empty means no key."""
    return args.api_key or environ.get(API_KEY_ENV) or None


def serve(args: argparse.Namespace) -> int:
    from hpi_runtime.config import EngineConfig
    from hpi_runtime.embedded import EMBEDDED_MODEL_NAME
    from hpi_runtime.server.main import serve as run_server
    from hpi_runtime.server.state import ServerSettings

    name = args.served_model_name or (
        EMBEDDED_MODEL_NAME if args.model is None else os.path.basename(os.path.normpath(args.model))
    )
    engine_settings = dict(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_waiting=args.max_num_waiting,
        kv_admission_watermark=args.kv_admission_watermark,
    )
    try:  # fail on bad flags now, before the model loads
        EngineConfig(**engine_settings, max_model_len=args.max_model_len or 1)
    except ValueError as exc:
        print(f"hpi serve: {exc}", file=sys.stderr)
        return 2
    settings = ServerSettings(served_model_name=name, api_key=api_key(args, os.environ),
                              max_request_body_bytes=args.max_request_body, drain_timeout_s=args.drain_timeout,
                              tool_call_parser=args.tool_call_parser,
                              allowed_origins=tuple(o.strip() for o in (args.allowed_origins or "").split(",")
                                                    if o.strip()))

    def load():
        import torch

        from hpi_runtime.llm import LoadConfig, default_max_model_len, prepare_engine, resolve_model_dir
        from hpi_runtime.models.config import load_model_config

        model_dir, _ = resolve_model_dir(args.model)
        max_model_len = args.max_model_len or default_max_model_len(load_model_config(model_dir))
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        load_config = LoadConfig(
            dtype=args.dtype,
            device=device,
            kv_cache_memory_bytes=args.kv_cache_memory,
            kv_offload_bytes=args.kv_offload_bytes,
            attention_backend=args.attention_backend,
            seed=args.seed,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
            quantize_lm_head=args.quantize_lm_head,
            int4_fit=args.int4_fit,
            int4_policy=args.int4_policy,
            tensor_parallel_size=args.tensor_parallel_size,
            enforce_eager=args.enforce_eager,
        )
        return prepare_engine(model_dir, EngineConfig(**engine_settings, max_model_len=max_model_len), load_config)

    return asyncio.run(run_server(settings, load, args.host, args.port))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        sys.exit(serve(args))


if __name__ == "__main__":
    main()
