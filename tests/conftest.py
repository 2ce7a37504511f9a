"""Shared pytest setup: hypothesis profiles (``ci`` runs more examples, derandomized)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=100, deadline=None)
# ci: derandomized, so that a run of CI is repeatable (a property failure found by a random
# search is kept as an explicit @example, fixed or marked, not left to chance).
settings.register_profile(
    "ci",
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
