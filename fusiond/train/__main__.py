"""`python -m fusiond.train JOB.toml`: train a job on N stages in this process, over loopback.

The command users type; the runner is a harness (it builds a cluster and runs a job) and lives
in `fusiond.harness.run`. Like every `__main__.py`, this entry point is imported by nothing.
"""

from __future__ import annotations

from fusiond.harness.run import main

if __name__ == "__main__":
    main()
