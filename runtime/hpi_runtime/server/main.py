"""Run the server: listen first (liveness answers at once), load and warm the model, serve, drain on SIGTERM.

Readiness is false while loading and from the first SIGTERM on. On SIGTERM new requests get 503, in-flight
ones finish within the drain timeout, then the process exits 0 (Kubernetes' rolling-update contract). If
the engine dies (a tensor-parallel worker killed, say) readiness and liveness fail at once and the process
exits 1 instead of lingering. A setting the engine cannot run (a --max-model-len above the model's positions, a
missing model directory, a bad --lora-modules directory, a KV cache too small for one request), an address it
cannot listen on: its message is logged in one line and the process exits 2, as for a bad flag; any other failed
load exits 1 with its traceback.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web

from hpi_runtime.lora.registry import LoRARegistry
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.server.app import build_app
from hpi_runtime.server.images import ImageSupport
from hpi_runtime.server.state import ServedModel, ServerSettings, ServerState

logger = logging.getLogger(__name__)


async def serve(settings: ServerSettings, prepare: Callable[[], Any], host: str, port: int) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code."""
    state = ServerState(settings)
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:  # a host that does not resolve, a port in use or not ours to take
        logger.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        await runner.cleanup()
        return 2
    logger.info("listening on http://%s:%d (loading the model; /ready says when it is done)", host, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loader: asyncio.Task[int | None] = asyncio.create_task(_load(state, prepare))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    engine_died = None
    if loader.done() and state.load_error is None:
        died = asyncio.create_task(state.model.engine.wait_dead())
        await asyncio.wait({stopper, died}, return_when=asyncio.FIRST_COMPLETED)
        engine_died = died.result() if died.done() else None
        died.cancel()
    exit_code = 0
    if state.load_error is not None:
        exit_code = loader.result() or 1
    elif engine_died is not None:
        # In-flight requests have already failed; nothing can be served any more: exit, and let the
        # supervisor (Kubernetes) start a fresh replica rather than keep an unready one around.
        logger.error("the engine died (%s); exiting", engine_died)
        exit_code = 1
    else:
        logger.info("draining: refusing new requests, waiting up to %.0f s for %d in flight",
                    settings.drain_timeout_s, state.in_flight)
        state.begin_drain()
        if not await state.wait_idle(settings.drain_timeout_s):
            logger.warning("drain timeout: %d requests still in flight are cut off", state.in_flight)
    stopper.cancel()
    loader.cancel()
    await runner.cleanup()
    if state.model is not None:
        await state.model.engine.shutdown()
    logger.info("stopped (exit code %d)", exit_code)
    return exit_code


async def _load(state: ServerState, prepare: Callable[[], Any]) -> int | None:
    """Check the settings and load the tokenizer here (`prepare` returns engine_factory's ResolvedEngine), then
    start the engine core in its own process, which loads the weights and allocates the KV cache. None once
    loaded, else the exit code: 2 for settings that cannot run (ValueError, FileNotFoundError until the core has
    started), 1 for anything else."""
    from hpi_runtime.core.core_process import CoreProcessSpec, ProcessCoreClient
    from hpi_runtime.frontend.async_engine import AsyncLLM
    from hpi_runtime.startup import PhaseClock, describe, process_age_s

    engine = None
    starting = True  # until the core has loaded: a ValueError is a setting
    clock = PhaseClock()
    imports_s = process_age_s()
    if imports_s is not None:
        clock.phases["imports"] = imports_s
    try:
        with clock("prepare"):
            prepared = await asyncio.get_running_loop().run_in_executor(None, prepare)
            loras = _load_lora_modules(prepared)  # a bad --lora-modules directory fails before the core starts
            images = ImageSupport.for_model(prepared.model_config, prepared.args.multimodal)
        spec = CoreProcessSpec(prepared.engine_config, prepared.executor_config, prepared.eos_token_ids,
                               logging.getLogger().getEffectiveLevel())
        engine = AsyncLLM(ProcessCoreClient(spec), prepared.tokenizer, prepared.engine_config)
        with clock("core_process"):
            info = await engine.start()
        starting = False
        core_phases = dict(info.startup)  # inside the core's start: what is left is spawning and its imports
        clock.phases["core_process"] = max(clock.phases["core_process"] - sum(core_phases.values()), 0.0)
        clock.phases.update(core_phases)
        with clock("warm_up"):
            await _warm_up(engine, prepared.tokenizer)
    except Exception as exc:  # reported on /ready and in the exit code
        state.load_error = f"{type(exc).__name__}: {exc}"
        settings = starting and isinstance(exc, (ValueError, FileNotFoundError))  # what the user typed
        if settings:
            logger.error("the model cannot be served with these settings: %s", exc,
                         exc_info=logger.isEnabledFor(logging.DEBUG))
        else:
            logger.exception("loading the model failed")
        if engine is not None:
            await engine.shutdown()
        return 2 if settings else 1
    footprint = info.footprint
    state.metrics.set_footprint(footprint)
    state.metrics.set_cache_config(prepared.args.cache, footprint)
    total_s = process_age_s()
    state.metrics.set_startup(clock.phases, total_s)
    logger.info("%s", describe(clock.phases, total_s))
    state.metrics.set_quantization(prepared.quantization, prepared.quantization_scheme)
    if loras is not None:
        state.metrics.set_max_loras(prepared.args.lora.max_loras)
    # A token id must be both decodable and a row of the embedding: the smaller of the two sizes bounds it.
    vocab_size = min(len(prepared.tokenizer), prepared.vocab_size)
    max_model_len = prepared.engine_config.max_model_len
    state.set_model(ServedModel(engine=engine, tokenizer=prepared.tokenizer, name=state.settings.served_model_name,
                                max_model_len=max_model_len, vocab_size=vocab_size,
                                sampling_defaults=prepared.sampling_defaults, loras=loras, images=images))
    if prepared.sampling_defaults:
        logger.info("sampling defaults from generation_config.json for requests that leave them out: %s",
                    prepared.sampling_defaults)
    # Everything allocated so far (tokenizer, modules) lives for the whole process: keep it out of the cyclic
    # GC's generations so collections during serving stay short (vLLM does the same; the core does it too).
    gc.collect()
    gc.freeze()
    logger.info("ready: %s (%s, quantization %s, on %s), weights %.1f MiB, KV cache %.1f MiB of %s in %d blocks, "
                "max_model_len %d; engine core in its own process", state.settings.served_model_name,
                prepared.dtype, prepared.quantization_detail, prepared.device, footprint.weight_bytes / 2**20,
                footprint.kv_cache_bytes / 2**20, str(prepared.executor_config.kv_dtype).removeprefix("torch."),
                footprint.num_kv_blocks, max_model_len)  # fmt: skip
    if footprint.num_host_kv_blocks:
        logger.info("host KV tier: %.1f MiB of host memory in %d blocks (offloaded prefix blocks, swapped-out "
                    "requests)", footprint.host_kv_cache_bytes / 2**20, footprint.num_host_kv_blocks)
    return None


def _load_lora_modules(prepared) -> LoRARegistry | None:
    """The adapter registry with --lora-modules loaded (ValueError for a bad one: the server does not start)."""
    lora = prepared.args.lora
    if not lora.enable_lora:
        return None
    registry = LoRARegistry(prepared.model_config, lora.max_lora_rank)
    for module in lora.modules:
        registry.load(module.name, module.path, module.base_model_name)
        logger.info("LoRA adapter '%s' from %s", module.name, module.path)
    return registry


async def _warm_up(engine, tokenizer) -> None:
    """One short greedy request through the whole path, so the first user request pays no first-call costs."""
    prompt_ids = tokenizer("Hello").input_ids or [0]
    async for _ in engine.generate("warmup", list(prompt_ids), SamplingParams(max_tokens=2, temperature=0.0)):
        pass
