"""fusiond.cluster."""
