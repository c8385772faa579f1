"""`hpi serve` flags that matter at the HTTP edge: the API key comes from --api-key or $HPI_API_KEY, and
--help never shows it; bad engine flags and settings the model cannot run stop the start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from hpi_runtime.cli import api_key, build_parser


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_help_does_not_print_the_api_key_from_the_environment() -> None:
    secret = "sk-canary-7f3a9c"
    result = subprocess.run(
        [sys.executable, "-m", "hpi_runtime.cli", "serve", "--help"],
        env={**os.environ, "HPI_API_KEY": secret},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "--api-key" in result.stdout and "HPI_API_KEY" in result.stdout
    assert secret not in result.stdout + result.stderr


def test_help_lists_the_supported_architectures() -> None:
    from hpi_runtime.models.registry import SUPPORTED_ARCHITECTURES

    serve_parser = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve_parser.format_help().split())  # argparse re-wraps the description
    for architecture in SUPPORTED_ARCHITECTURES:
        assert architecture in text


def test_api_key_flag_then_environment_then_none() -> None:
    assert api_key(serve_args("--api-key", "from-flag"), {"HPI_API_KEY": "from-env"}) == "from-flag"
    assert api_key(serve_args(), {"HPI_API_KEY": "from-env"}) == "from-env"
    assert api_key(serve_args(), {}) is None
    assert api_key(serve_args(), {"HPI_API_KEY": ""}) is None  # set but empty: no key, not an empty key


def test_bad_engine_flags_stop_before_the_model_loads() -> None:
    """A bad value exits 2 with the library's message, in about the time it takes to import the CLI."""
    result = subprocess.run(
        [sys.executable, "-m", "hpi_runtime.cli", "serve", "--kv-admission-watermark", "1.5", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "kv_admission_watermark must be in [0, 1), got 1.5" in result.stderr
    assert serve_args("--kv-admission-watermark", "0").kv_admission_watermark == 0.0


def test_a_bad_pool_profile_stops_before_the_model_loads() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hpi_runtime.cli", "serve", "--pool-profile", '{"itlAlphaMs": 1}', "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "a pool profile needs itlBetaMs, prefillTokensPerSecond, maxNumSeqs" in result.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-model-len", "999999"], "max_model_len 999999 exceeds the model's max_position_embeddings 8192"),
        (["--model", "/nonexistent/model"], "model directory '/nonexistent/model' does not exist"),
        (["--model", sys.executable], "is a file: give its directory"),
        (["--kv-cache-memory", "100000GiB"], "the KV cache needs 100000.0 GiB of host memory"),
        (["--kv-cache-memory", "1KiB"], "KV cache budget of 1024 bytes holds 0 blocks"),  # found in the core process
        (["--host", "256.1.1.1"], "cannot listen on 256.1.1.1:"),
        (["--port", "65536"], "port must be in [0, 65535]"),
    ],
)
def test_settings_the_model_cannot_run_exit_2_with_their_message_and_no_traceback(argv, message) -> None:
    """Most are found after the server listens (once the model's config is read, or in the core process as it
    sizes the KV cache): still a user's setting, so the message in one line and exit 2, as for a bad flag (a
    failure of another kind exits 1 with its stack)."""
    result = subprocess.run(
        [sys.executable, "-m", "hpi_runtime.cli", "serve", "--port", "0", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_port_already_taken_exits_2_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "hpi_runtime.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "address already in use" in result.stderr
    assert "Traceback" not in result.stderr
