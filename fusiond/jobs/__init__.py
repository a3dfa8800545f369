"""fusiond.jobs."""
