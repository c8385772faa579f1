"""A fleet simulator that runs our real code: simulated replicas (replica.py: continuous batching, chunked prefill,
KV budget and preemption, step times from a pool's profile) behind the real router policy (routing.py), scaled by
the operator's real decisions (scaling.py: the fleet optimizer, or the KV-utilisation autoscaler with rank-fill
placement), over seeded workloads (workloads.py). One event heap drives it all (engine.py); each replica is
advanced analytically between its own events, not step by step.

Entry points: `python -m bench.fleet_sim` (the scenarios behind bench/results/fleet.md) and `replay.replay`
(an explicit request list against N replicas, for calibration against a real run).
"""
