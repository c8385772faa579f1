"""The fleet optimizer: replicas per pool at the lowest cost that meets a latency SLO, from each pool's measured
performance and price. Pure functions of plain dataclasses (no I/O, no clock), so the autoscaler loop, the
fleet simulator (bench/fleet_sim) and the tests all call the same code."""
