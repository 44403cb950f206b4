"""Runnable examples; see each module's docstring (and README, "Examples")."""
