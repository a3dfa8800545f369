"""fusiond.net."""
