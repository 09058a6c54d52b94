"""The embedded default's cache: Django's file cache, with `incr` and `add` atomic across processes.

Without Redis the web server's threads and processes and the worker share
the cache through files. Django's file cache writes each entry atomically
(a temporary file renamed into place), but its `incr` is a read then a
write and its `add` a look then a write: two processes incrementing at once
both get the same number. The placement change feed (inventory/changes.py)
takes a version with `incr` and stores a node list under it, so two marks at
the same moment became one version, one list lost, and a worker's kept
placement index that never learnt of a drained node until its periodic
rebuild. The one-waiting-reconcile key and the lease queue use `add` the same
way. Here both run under an exclusive lock on one file beside the entries
(flock: it also excludes other threads of the same process, each opening the
file for itself). Reads and plain writes take no lock; the lock file does not
end in the entries' suffix, so culling and clear() never count it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from django.core.cache.backends.base import DEFAULT_TIMEOUT
from django.core.cache.backends.filebased import FileBasedCache

LOCK_NAME = ".llmgw-lock"


class FileCache(FileBasedCache):
    """Django's FileBasedCache whose read-modify-write operations hold a lock shared by every process."""

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self._createdir()
        fd = os.open(os.path.join(self._dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def add(self, key: str, value: Any, timeout: Any = None, version: int | None = None) -> bool:
        """Set `key` only if it is absent (or expired), atomically; whether it was set."""
        with self._locked():
            return super().add(key, value, timeout, version)

    def incr(self, key: str, delta: int = 1, version: int | None = None) -> int:
        """Add `delta` to the stored number, atomically; raises ValueError when the key is absent."""
        with self._locked():
            return super().incr(key, delta, version)

    def incr_then_set(self, counter: str, entry_prefix: str, value: Any, timeout: Any = DEFAULT_TIMEOUT) -> int:
        """Add one to `counter` and store `value` under `entry_prefix` + the new number, atomically.

        As llmgw/cache.py's: ValueError when the counter is absent.
        """
        with self._locked():
            version = super().incr(counter)
            self.set(f"{entry_prefix}{version}", value, timeout)
        return version

    def touch_and_read(
        self, touch: Sequence[str], read: Sequence[str], timeout: Any = DEFAULT_TIMEOUT
    ) -> tuple[set[str], dict[str, Any]]:
        """As llmgw/cache.py's: `timeout` more seconds for every key; which of `touch` exist, and `read`'s values."""
        touched = {k for k in touch if self.touch(k, timeout)}
        values = {}
        for k in read:
            value = self.get(k)
            if value is not None and self.touch(k, timeout):
                values[k] = value
        return touched, values
