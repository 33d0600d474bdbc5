"""Training draft heads and small LMs in JAX (see submodules)."""
