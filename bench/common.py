"""What the database benchmarks share: a scratch database and a statement counter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class StatementCounter:
    """Counts the statements a block sends to the database (savepoints included)."""

    def __init__(self, connection) -> None:
        self.connection, self.count = connection, 0

    def __call__(self, execute, sql, params, many, context):
        self.count += 1
        return execute(sql, params, many, context)

    def __enter__(self) -> StatementCounter:
        self._cm = self.connection.execute_wrapper(self)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._cm.__exit__(*exc)


@contextmanager
def scratch_database(suffix: str) -> Iterator[None]:
    """A freshly migrated database of the benchmark's own, dropped afterwards.

    Named after the configured one plus `suffix`, so a benchmark never
    clobbers the test suite's database or another benchmark's.
    """
    from django.db import connection

    old_name = connection.settings_dict["NAME"]
    connection.settings_dict.setdefault("TEST", {})["NAME"] = f"{old_name}_{suffix}"
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        yield
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)
