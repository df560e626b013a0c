"""The identity of a result: which row, which implementation and which environment it measured.

Every job writes `identity(...)` into its result JSON; the report compares it with what it expects for the
file's row (`mismatches`) and refuses a result that measured something else.
"""

from __future__ import annotations

import hashlib

from shapewise.inputs.manifest import row_json

FIELDS = ("row_id", "row_digest", "implementation_digest", "environment_digest")


def row_digest(row: dict) -> str:
    """SHA-256 of the row's canonical JSON (manifest.row_json: the fields that define its results)."""
    return hashlib.sha256(row_json(row).encode()).hexdigest()


def identity(row: dict | None, implementation_digest: str | None, environment_digest: str | None) -> dict:
    """{"row_id", "row_digest", "implementation_digest", "environment_digest"}; row fields None without a row."""
    return {
        "row_id": row["id"] if row is not None else None,
        "row_digest": row_digest(row) if row is not None else None,
        "implementation_digest": implementation_digest,
        "environment_digest": environment_digest,
    }


def mismatches(result: dict, expected: dict) -> list[str]:
    """Human-readable differences between a result's identity and the expected one; [] when they agree."""
    found = result.get("identity") if isinstance(result, dict) else None
    if not isinstance(found, dict):
        return ["the result has no identity"]
    problems = []
    for field in FIELDS:
        if field not in expected:
            continue
        if field not in found:
            problems.append(f"{field} is missing, expected {expected[field]!r}")
        elif found[field] != expected[field]:
            problems.append(f"{field} is {found[field]!r}, expected {expected[field]!r}")
    return problems
