"""vpool.web: the coordinator's read-only HTML dashboard (``dashboard``, ``templates/``)."""
