"""fusiond.graph."""
