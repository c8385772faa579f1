"""`hpi`: the runtime's command line (`hpi serve`, `hpi profile`; the router is its own package, `hpi-router`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping

from hpi_contracts.pool_profile import parse_pool_profile
from hpi_runtime.config import API_KEY_ENV, EngineArgs, ServerConfig, engine_options, server_options
from hpi_runtime.models.registry import SUPPORTED_ARCHITECTURES  # imports no torch: --help stays fast
from hpi_runtime.options import OptionSpec, add_flags
from hpi_runtime.profiling import DEFAULT_BATCH_SIZES, DEFAULT_PROMPT_LENGTHS  # imports no torch
from hpi_runtime.worker.pp_layout import resolve_layout  # imports no torch


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
    # Every flag is generated from the config tree: one argument group per section.
    sections: dict[str, list[OptionSpec]] = {}
    for spec in [*engine_options(), *server_options()]:
        sections.setdefault(spec.section, []).append(spec)
    for section, specs in sections.items():
        add_flags(serve.add_argument_group(section), specs)
    profile = sub.add_parser(
        "profile",
        help="measure this replica's speed for the operator's fleet optimizer",
        description="Load the model as `hpi serve` would and measure its decode step time against the batch size "
        "(fitted as ITL = alpha + beta x batch), its prefill throughput and the sequences its KV cache holds; print "
        "JSON whose first four fields are spec.placement.pools[].performance (docs/autoscaling.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    engine_sections: dict[str, list[OptionSpec]] = {}
    for spec in engine_options():
        engine_sections.setdefault(spec.section, []).append(spec)
    for section, specs in engine_sections.items():
        add_flags(profile.add_argument_group(section), specs)
    measured = profile.add_argument_group("profile")
    measured.add_argument("--context-tokens", type=int, default=1024,
                          help="tokens of context per sequence: decode steps are timed with this much KV per "
                          "sequence, and the KV capacity is counted at it")  # fmt: skip
    measured.add_argument("--batch-sizes", type=_int_list, default=list(DEFAULT_BATCH_SIZES),
                          help="comma-separated decode batch sizes to time (each <= --max-num-seqs)")
    measured.add_argument("--prompt-lengths", type=_int_list, default=list(DEFAULT_PROMPT_LENGTHS),
                          help="comma-separated prompt lengths to time the prefill of")
    measured.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    measured.add_argument("--output", default=None, help="write the JSON here as well as to stdout")
    measured.add_argument("--compact", action="store_true",
                          help="one line within 4096 bytes (the points dropped if need be): the operator's profiling "
                          "Job writes it to /dev/termination-log, Kubernetes' termination message")  # fmt: skip
    measured.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return parser


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("at least one value")
    return values


def api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--api-key, else $HPI_API_KEY; empty means no key."""
    return args.api_key or environ.get(API_KEY_ENV) or None


def serve(args: argparse.Namespace) -> int:
    from hpi_runtime.embedded import EMBEDDED_MODEL_NAME
    from hpi_runtime.server.lora import runtime_lora_updating_allowed
    from hpi_runtime.server.main import serve as run_server
    from hpi_runtime.server.state import ServerSettings

    try:  # fail on bad flags now, before the model loads
        engine_args = EngineArgs.from_options(**{spec.name: getattr(args, spec.name) for spec in engine_options()})
        server = ServerConfig(**{spec.name: getattr(args, spec.name) for spec in server_options()})
        layout = resolve_layout(engine_args.parallel, os.environ)
    except ValueError as exc:
        print(f"hpi serve: {exc}", file=sys.stderr)
        return 2
    if not layout.is_leader:
        return _serve_worker_host(engine_args, layout, server)
    model = engine_args.load.model
    name = server.served_model_name or (
        EMBEDDED_MODEL_NAME if model is None else os.path.basename(os.path.normpath(model))
    )
    settings = ServerSettings(served_model_name=name, api_key=api_key(args, os.environ),
                              max_request_body_bytes=server.max_request_body_bytes,
                              drain_timeout_s=server.drain_timeout_s, tool_call_parser=server.tool_call_parser,
                              pool_profile=None if server.pool_profile is None or server.pool_profile_path
                              else parse_pool_profile(server.pool_profile),
                              pool_profile_path=server.pool_profile_path,
                              allow_runtime_lora_updating=runtime_lora_updating_allowed(os.environ),
                              allowed_origins=tuple(o.strip() for o in (server.allowed_origins or "").split(",")
                                                    if o.strip()))  # fmt: skip

    def resolve():
        from hpi_runtime.engine_factory import resolve_engine

        return resolve_engine(engine_args)

    return asyncio.run(run_server(settings, resolve, server.host, server.port))


def _serve_worker_host(engine_args: EngineArgs, layout, server: ServerConfig) -> int:
    """A pipeline group's host other than the leader: its ranks and GET /health only (worker/pp_host.py)."""
    from hpi_runtime.engine_factory import resolve_engine
    from hpi_runtime.worker.pp_host import run_worker_host

    try:
        resolved = resolve_engine(engine_args)  # the same checks as the leader's, so a bad group fails everywhere
    except ValueError as exc:
        print(f"hpi serve: {exc}", file=sys.stderr)
        return 2
    return run_worker_host(resolved.executor_config, layout, server.host, server.port)


def profile(args: argparse.Namespace) -> int:
    import json

    from hpi_runtime.engine_factory import create_engine
    from hpi_runtime.profiling import compact_json, machine, measure

    try:
        engine_args = EngineArgs.from_options(**{spec.name: getattr(args, spec.name) for spec in engine_options()})
        bundle = create_engine(engine_args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"hpi profile: {exc}", file=sys.stderr)
        return 2
    try:
        result = measure(bundle, args.context_tokens, args.batch_sizes, args.prompt_lengths, args.steps)
    except ValueError as exc:
        print(f"hpi profile: {exc}", file=sys.stderr)
        return 2
    finally:
        bundle.engine.shutdown()
    resolved = bundle.resolved
    payload = result.as_json({"device": resolved.device, "dtype": resolved.dtype, **machine()})
    text = compact_json(payload) if args.compact else json.dumps(payload, indent=1)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        sys.exit(serve(args))
    if args.command == "profile":
        sys.exit(profile(args))


if __name__ == "__main__":
    main()
