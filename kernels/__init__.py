"""Pallas kernels, each with a plain-jnp reference beside it (installed as ``specjax.kernels``)."""
