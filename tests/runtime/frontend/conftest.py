"""The frontend tests drive a real engine core over the core tests' fake executor: share those fixtures."""

from __future__ import annotations

from ..core.conftest import drain, expected_token, fake_executor_cls, pool_invariants, tokenizer  # noqa: F401
