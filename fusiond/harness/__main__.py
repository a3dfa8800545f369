"""`python -m fusiond.harness JOB.toml`: the same as `python -m fusiond.train JOB.toml`."""

from __future__ import annotations

from fusiond.harness.run import main

if __name__ == "__main__":
    main()
