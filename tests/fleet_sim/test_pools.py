"""The headline fleet's H200 pool from its GPU measurement: the measured alpha and prefill, the measured beta plus
the roofline's KV reads for the context beyond the one it was measured at; the roofline estimate otherwise."""

from __future__ import annotations

import pytest
from fleet_sim.pools import MEASURED_H200, headline_pools

CONTEXT = 1260.5  # the headline's mean context (prompt + half the output)


def test_the_measured_h200_adds_the_kv_reads_of_the_longer_context() -> None:
    assumed = headline_pools(CONTEXT)[0]
    measured = headline_pools(CONTEXT, h200="measured")[0]
    a, m = assumed.performance_at(CONTEXT), measured.performance_at(CONTEXT)
    assert (a.source, m.source) == ("assumed", "measured")
    assert m.itl_alpha_s == MEASURED_H200["alpha_s"] and m.prefill_tokens_per_s == MEASURED_H200["prefill_tokens_per_s"]
    # The roofline's beta is KV reads alone, linear in the context: what it adds from 26 to 1,260.5 tokens.
    kv_added = a.itl_beta_s * (CONTEXT - MEASURED_H200["context_tokens"]) / CONTEXT
    assert m.itl_beta_s == pytest.approx(MEASURED_H200["beta_s"] + kv_added)
    at_measured_context = measured.performance_at(MEASURED_H200["context_tokens"])
    assert at_measured_context.itl_beta_s == pytest.approx(MEASURED_H200["beta_s"])
    # The simulated replicas run the same figures the optimizer reads; only the H200 pool changes.
    assert measured.engine.performance.itl_beta_s == m.itl_beta_s and m.max_num_seqs == a.max_num_seqs
    assert [p.performance_at(CONTEXT) for p in headline_pools(CONTEXT, h200="measured")[1:]] == [
        p.performance_at(CONTEXT) for p in headline_pools(CONTEXT)[1:]
    ]
    with pytest.raises(ValueError, match="h200 must be"):
        headline_pools(CONTEXT, h200="guessed")
