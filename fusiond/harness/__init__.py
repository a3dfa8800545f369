"""fusiond.harness: the daemon's job path without the daemon, for tests, benchmarks and the
single-command local run. Harnesses build transports and clusters and run jobs; they sit above
every product room, and nothing in the product imports them (tests/test_layers.py).

- `inproc`: several nodes in one process over loopback, a PeerNetwork and a JobWorker each.
- `node`: a bare job node in its own process (`python -m fusiond.harness.node`), `spawn_nodes`.
- `loopback`: a captured job over real peer links on loopback, in one process.
- `run`: `python -m fusiond.train JOB.toml` (also `python -m fusiond.harness JOB.toml`).
"""
