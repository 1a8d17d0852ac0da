"""`node simulate`: S stages x R replicas in one process, on a simulated clock, driving the project's
own stage workers, outer steps, rebuild plans and routers (docs/results.md shows what it measures).

Pure pieces, each beside its paper: clock.py (the simulated clock), links.py (latency + bytes /
bandwidth), failures.py (per-hour rates -> per-iteration probabilities, the CheckFree paper's
conversion), collectives.py (NoLoCo round vs tree and ring all-reduce), timeline.py (when one
iteration's microbatches finish on single-server stages). swarm.py holds the replicas and runs the
real code; the experiments are recovery.py, sync_scaling.py, gossip.py; experiments.py names them.
"""
