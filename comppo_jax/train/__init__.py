"""Training: the loop (`loop.train`), update steps, method recipes, the phase controller, the
supervised warm start and the paper's settings (`paper`)."""
