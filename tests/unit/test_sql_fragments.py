"""SQL fragments (lease_celery/stores/queries.py): a piece two statements share is written
once in the dialect's file and put into each query that names it, at that line's indentation."""

from __future__ import annotations

import pytest

from lease_celery.stores.queries import load_queries, parse_queries

TEXT = """
-- name: fragment_sets
-- a comment of the fragment's own, left out
a = 1,
b = 2,

-- name: first
UPDATE t SET
    {fragment_sets}
    c = 3

-- name: second
SELECT 1
"""


def test_a_fragment_goes_into_each_query_that_names_it_and_is_no_query_itself() -> None:
    queries = parse_queries(TEXT, source="test.sql")
    assert queries == {"first": "UPDATE t SET\n    a = 1,\n    b = 2,\n    c = 3",
                       "second": "SELECT 1"}


def test_a_fragment_the_file_does_not_define_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"test.sql: query 'first' uses a fragment"):
        parse_queries(TEXT.replace("{fragment_sets}", "{fragment_other}"), source="test.sql")


def test_postgres_claims_share_what_a_claim_sets_on_the_row() -> None:
    """The plain claim and the limited claim's function set the same columns the same way
    (token + 1, attempts, takeovers, the delivery's task info) from one text."""
    queries = load_queries("postgres")
    assert not any(name.startswith("fragment_") for name in queries)
    for name in ("claim", "create_claim_limited_function"):
        assert "token      = l.token + 1," in queries[name], name
        assert "never a previous one's" in queries[name], name
        assert "{fragment_" not in queries[name]
