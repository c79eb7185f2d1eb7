"""Credit estimators (paper sections 3-4)."""
