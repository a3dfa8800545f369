"""fusiond.plan."""
