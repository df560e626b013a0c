"""The identity every result carries: row id and digest, implementation and environment digests."""

from __future__ import annotations

import hashlib

from shapewise.inputs.manifest import normalize_row, row_json
from shapewise.provenance.identity import identity, mismatches, row_digest

ROW = normalize_row({"id": "id-row", "batch_size": 2, "seq_len": 8, "d_model": 32, "num_heads": 2, "ffn_dim": 64,
                     "num_layers": 1})


def test_row_digest_is_the_sha256_of_the_rows_canonical_json():
    assert row_digest(ROW) == hashlib.sha256(row_json(ROW).encode()).hexdigest()


def test_row_digest_follows_what_defines_the_results_only():
    assert row_digest(dict(ROW, batch_size=3)) != row_digest(ROW)
    assert row_digest(dict(ROW, description="words", manifest="shapes/x.yaml")) == row_digest(ROW)


def test_identity_fields_and_non_row_jobs():
    ident = identity(ROW, "impl", "env")
    assert ident == {"row_id": "id-row", "row_digest": row_digest(ROW), "implementation_digest": "impl",
                     "environment_digest": "env"}
    assert identity(None, "impl", "env") == {"row_id": None, "row_digest": None, "implementation_digest": "impl",
                                             "environment_digest": "env"}


def test_mismatches_name_each_differing_field():
    expected = identity(ROW, "impl", "env")
    assert mismatches({"identity": dict(expected)}, expected) == []
    other = normalize_row(dict(ROW, id="other-row", batch_size=4))
    found = {"identity": identity(other, "impl", "old-env")}
    problems = mismatches(found, expected)
    assert problems == [
        "row_id is 'other-row', expected 'id-row'",
        f"row_digest is {row_digest(other)!r}, expected {row_digest(ROW)!r}",
        "environment_digest is 'old-env', expected 'env'",
    ]


def test_mismatches_of_a_result_without_identity():
    assert mismatches({"step": "timing"}, identity(ROW, "i", "e")) == ["the result has no identity"]
    partial = {"identity": {"row_id": "id-row"}}
    assert mismatches(partial, {"row_id": "id-row", "row_digest": "d"}) == ["row_digest is missing, expected 'd'"]
