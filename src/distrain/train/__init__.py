"""distrain's own training loop (``distrain train``, ``distrain.fit``) and its metrics; it drives
the algorithm through :class:`~distrain.distributed.DistributedOptimizer` like any user loop."""
