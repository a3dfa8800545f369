"""fusiond.train: training a partitioned model.

- `spec`: the job file (TOML) -> validated `JobSpec`; `data`: deterministic data sources
  (batches of named tensors, the objectives' labels, the held-out split); `readers`: data on
  disk (JSON lines, Parquet, saved `datasets`, image folders, tokenizers), read where the job
  is submitted; `model`: model factories, how a batch reaches the model (`resolve_feed`) and
  the objectives' losses; `evaluate`: the held-out loss; `optim`: optimizers and LR
  schedules.
- `schedule`: 1F1B / GPipe task orders; `stage`: the `StageExecutor` (one partition's tasks,
  optimizer and links); `codec`: edge tensors through `protocol.tensors` (RAW, TOPK/VALUES).
- `programs`: capture a job and build stage programs from `fusiond.graph` partitions;
  `remote`: a stage built from an `Assign`, talking over the peer network (`StageHost`).
- `local`: the whole pipeline in one process over in-memory links, and the eager reference
  trainer; `sample`: text generation. (Over real loopback peer links: `fusiond.harness`.)
- `python -m fusiond.train JOB.toml`: a job end to end on loopback (see docs/jobs.md); the
  runner is `fusiond.harness.run`.
"""
