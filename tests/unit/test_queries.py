"""The named statements: fragments written once and included where statements use them."""

from __future__ import annotations

from oncely.storage.queries import driver_query, query, query_names

READERS = ("relay_read", "relay_rows", "republish_rows")


def test_every_row_to_publish_is_selected_by_one_fragment() -> None:
    texts = [driver_query(name) for name in READERS]
    heads = [text[text.index("SELECT") : text.index(" AS available_at")] for text in texts]
    columns = {head.rsplit(",", 1)[0] for head in heads}
    assert len(columns) == 1
    assert columns.pop().endswith("o.tracingspancontext")


def test_a_fragment_is_no_statement_and_leaves_no_placeholder_or_comment() -> None:
    assert "row_to_publish" not in query_names()
    for name in READERS:
        assert "{" not in str(query(name))
        assert "--" not in driver_query(name)
