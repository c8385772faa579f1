"""`hpi`: the runtime's command line (`hpi serve`; the router is its own package, `hpi-router`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping

from hpi_runtime.config import API_KEY_ENV, EngineArgs, ServerConfig, engine_options, server_options
from hpi_runtime.models.registry import SUPPORTED_ARCHITECTURES  # imports no torch: --help stays fast
from hpi_runtime.options import OptionSpec, add_flags


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
    return parser


def api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--api-key, else $HPI_API_KEY; empty means no key."""
    return args.api_key or environ.get(API_KEY_ENV) or None


def serve(args: argparse.Namespace) -> int:
    from hpi_runtime.embedded import EMBEDDED_MODEL_NAME
    from hpi_runtime.server.main import serve as run_server
    from hpi_runtime.server.state import ServerSettings

    try:  # fail on bad flags now, before the model loads
        engine_args = EngineArgs.from_options(**{spec.name: getattr(args, spec.name) for spec in engine_options()})
        server = ServerConfig(**{spec.name: getattr(args, spec.name) for spec in server_options()})
    except ValueError as exc:
        print(f"hpi serve: {exc}", file=sys.stderr)
        return 2
    model = engine_args.load.model
    name = server.served_model_name or (
        EMBEDDED_MODEL_NAME if model is None else os.path.basename(os.path.normpath(model))
    )
    settings = ServerSettings(served_model_name=name, api_key=api_key(args, os.environ),
                              max_request_body_bytes=server.max_request_body_bytes,
                              drain_timeout_s=server.drain_timeout_s, tool_call_parser=server.tool_call_parser,
                              allowed_origins=tuple(o.strip() for o in (server.allowed_origins or "").split(",")
                                                    if o.strip()))  # fmt: skip

    def resolve():
        from hpi_runtime.engine_factory import resolve_engine

        return resolve_engine(engine_args)

    return asyncio.run(run_server(settings, resolve, server.host, server.port))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        sys.exit(serve(args))


if __name__ == "__main__":
    main()
