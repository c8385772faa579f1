"""What the engine-core process boundary costs: encoding a step's messages, and a round trip over the pipe.

The core sends one `CoreOutputs` per step (one delta per running request) and receives one `AddRequest` per
request; both are pickled by multiprocessing.Connection (protocol 5). This measures, for 1..256 running
requests, the bytes and the encode+decode time of a decode step's message, the same for an AddRequest with a
2,000-token prompt, and the wall time of a message round trip between two processes over the same kind of
pipe, against a decode step of the embedded model (tens of milliseconds on these CPUs).

    .venv/bin/python -m bench.bench_engine_process
"""

from __future__ import annotations

import multiprocessing
import pickle
import time

from hpi_runtime.core.engine_io import (
    AddRequest,
    CoreOutputs,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
)
from hpi_runtime.core.interface import TokenLogprobs
from hpi_runtime.sampling_params import SamplingParams


def step_message(num_requests: int, with_logprobs: bool) -> CoreOutputs:
    outputs = tuple(
        EngineCoreOutput(
            request_id=f"cmpl-{'0' * 32}-{i}",
            new_token_ids=(1234,),
            new_logprobs=(TokenLogprobs(1234, -0.5, tuple((j, -1.0 - j) for j in range(5))),) if with_logprobs else (),
            num_cached_prompt_tokens=0,
            first_scheduled_time=time.monotonic(),
        )
        for i in range(num_requests)
    )
    return CoreOutputs(outputs, EngineStats(num_requests, 0, 0.5, 1000, 100, 0, 10_000, 20_000))


def add_message(num_prompt_tokens: int) -> AddRequest:
    return AddRequest(
        EngineCoreRequest("cmpl-x", tuple(range(num_prompt_tokens)), SamplingParams(max_tokens=128), 128, 0.0)
    )


def codec_us(message: object, repeats: int = 2000) -> tuple[int, float]:
    data = pickle.dumps(message, protocol=5)
    start = time.perf_counter()
    for _ in range(repeats):
        pickle.loads(pickle.dumps(message, protocol=5))
    return len(data), (time.perf_counter() - start) / repeats * 1e6


def _echo(conn) -> None:
    while True:
        message = conn.recv()
        if message is None:
            return
        conn.send(message)


def round_trip_us(message: object, repeats: int = 500) -> float:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_echo, args=(child,))
    process.start()
    parent.send(message)
    parent.recv()  # warm
    start = time.perf_counter()
    for _ in range(repeats):
        parent.send(message)
        parent.recv()
    elapsed = (time.perf_counter() - start) / repeats * 1e6
    parent.send(None)
    process.join()
    return elapsed


def main() -> None:
    print("| message | bytes | pickle encode+decode (us) | round trip through a pipe (us) |")
    print("|---|---:|---:|---:|")
    for num_requests in (1, 32, 64, 256):
        for with_logprobs in (False, True):
            message = step_message(num_requests, with_logprobs)
            size, codec = codec_us(message)
            rtt = round_trip_us(message) if num_requests in (1, 64) and not with_logprobs else float("nan")
            name = f"step outputs, {num_requests} requests" + (", top-5 logprobs" if with_logprobs else "")
            print(f"| {name} | {size:,} | {codec:.1f} | {rtt:.0f} |")
    for num_tokens in (128, 2000):
        size, codec = codec_us(add_message(num_tokens))
        print(f"| AddRequest, {num_tokens}-token prompt | {size:,} | {codec:.1f} | |")


if __name__ == "__main__":
    main()
