"""What a job needs installed: its requirements, as ``vsdk submit --requirements FILE`` or a
project's ``pyproject.toml`` declares them, checked and normalized the same way everywhere.

Only named requirements from the package index are accepted (``numpy>=1.26``,
``astropy[all]==6.0``, with environment markers): no URLs, local paths or pip options, so an
environment is the same wherever it is built. ``key`` names an environment: the same
requirements (in any order, spelled alike) give the same key, which agents report for the
environments they have built and the coordinator uses to prefer them.
"""

from __future__ import annotations

import hashlib

from packaging.requirements import InvalidRequirement, Requirement

MAX_REQUIREMENTS = 200
MAX_LENGTH = 200


class RequirementsError(ValueError):
    """Requirements that cannot be accepted; the message says which line and why."""


def parse_lines(text: str, source: str = "requirements") -> list[str]:
    """The requirements of a requirements.txt (comments and blank lines skipped)."""
    found = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            raise RequirementsError(
                f"{source}, line {number}: pip options ({line.split()[0]}) are not accepted; "
                "list package requirements only"
            )
        found.append(line)
    return normalize(found, source)


def normalize(requirements: list[str], source: str = "requirements") -> list[str]:
    """Each requirement checked and spelled canonically, sorted, without duplicates."""
    if len(requirements) > MAX_REQUIREMENTS:
        raise RequirementsError(
            f"{source}: {len(requirements)} requirements, more than {MAX_REQUIREMENTS}"
        )
    out = set()
    for text in requirements:
        if len(text) > MAX_LENGTH:
            raise RequirementsError(f"{source}: {text[:40]!r}... is longer than {MAX_LENGTH}")
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            raise RequirementsError(f"{source}: {text!r} is not a requirement: {exc}") from exc
        if req.url:
            raise RequirementsError(
                f"{source}: {text!r} names a URL; only packages of the index are accepted"
            )
        out.add(str(req))
    return sorted(out)


def from_pyproject(text: str, source: str = "pyproject.toml") -> list[str]:
    """The ``[project] dependencies`` of a pyproject.toml, normalized ([] if none)."""
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RequirementsError(f"{source} is not valid TOML: {exc}") from exc
    declared = data.get("project", {}).get("dependencies", [])
    if not isinstance(declared, list) or not all(isinstance(d, str) for d in declared):
        raise RequirementsError(f"{source}: [project] dependencies is not a list of strings")
    return normalize(declared, source)


def key(requirements: list[str]) -> str:
    """The name of the environment of ``requirements`` (already normalized)."""
    return hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:16]
