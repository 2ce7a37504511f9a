"""vpool.coordinator: the pool's HTTPS API, scheduler and state.

Layout by concern: ``settings``; ``app`` (FastAPI app, error shape) with the routers
``api_jobs``, ``api_agents``, ``api_relays`` over ``transport`` (msgspec JSON, bearer tokens);
``service`` (the behaviour behind the routers); ``scheduler`` (placement and job-end rules, the
monitor loop); ``store`` (the storage interface) implemented by ``sqlite_store``/``sqlite_jobs``
with ``migrations``; ``blobs`` and ``results`` (files); ``keys`` (signing key, API tokens);
``serve`` and ``cli`` (the ``vpool-coordinator`` command).
"""
