"""optax training of drafters, routers and online adapters (installed as ``specjax.train``)."""
