"""fusiond.train."""
