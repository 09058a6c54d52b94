"""What the agent keeps on disk between runs: its credential, its join nonce, and the applied-command journal.

All of it lives in the state directory (mode 0700); the secrets are written
0600 and atomically, so a crash leaves the old file or the new, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
from pathlib import Path

# Command ids remembered as applied: enough to outlast the control plane's
# repeats of any command, bounded so the journal does not grow for ever.
APPLIED_KEEP = 2000


class CredentialFile:
    """This node's own credential (state_dir/credential) and the nonce of a join in progress."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    @property
    def path(self) -> Path:
        """Where the credential is kept."""
        return self.state_dir / "credential"

    @property
    def join_nonce_path(self) -> Path:
        """Where the join nonce is kept until the join succeeds."""
        return self.state_dir / "join-nonce"

    def read(self) -> str:
        """This node's own credential, '' before the first registration."""
        try:
            return self.path.read_text().strip()
        except OSError:
            return ""

    def save(self, value: str) -> None:
        """Store the credential atomically: a crash leaves the old file or the new, never half of one.

        The temporary file is created 0600 in the same directory (so the
        rename stays on one filesystem) and synced before it replaces the old
        one; the directory is synced after, so the rename itself survives a
        power loss.
        """
        fd, tmp = tempfile.mkstemp(prefix=".credential-", suffix=".tmp", dir=self.state_dir)
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):
            dfd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def join_nonce(self) -> str:
        """The secret that makes a retried join recognisable as this agent's, drawn once and kept until joined.

        Written before the first try, so a join whose answer was lost (the
        agent timed out, the server went on and issued the credential) is
        retried with the same nonce, and gets the credential again.
        """
        path = self.join_nonce_path
        with contextlib.suppress(OSError):
            value = path.read_text().strip()
            if len(value) >= 32:
                return value
        value = secrets.token_urlsafe(32)
        fd, tmp = tempfile.mkstemp(prefix=".join-nonce-", suffix=".tmp", dir=self.state_dir)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return value

    def forget_join_nonce(self) -> None:
        """Joined: the next join (after an operator's reset) is a new one, with a new nonce."""
        self.join_nonce_path.unlink(missing_ok=True)


class AppliedJournal:
    """The ids of the commands applied (state_dir/applied.json), so a restarted agent applies none twice.

    The caller serialises calls to record (the command handler's lock).
    """

    def __init__(self, path: Path, *, keep: int = APPLIED_KEEP) -> None:
        self.path = path
        self.keep = keep
        # Command id -> when it was applied (the agent's clock).
        self.ids: dict[str, float] = self._load()

    def _load(self) -> dict[str, float]:
        try:
            data = json.loads(self.path.read_text())
            return {str(k): float(v) for k, v in data.items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def __contains__(self, cmd_id: object) -> bool:
        return cmd_id in self.ids

    def record(self, cmd_id: str, at: float) -> None:
        """Remember a command as applied, forgetting the oldest beyond `keep`, and write the journal."""
        self.ids[cmd_id] = at
        if len(self.ids) > self.keep:
            for k in sorted(self.ids, key=self.ids.__getitem__)[: len(self.ids) - self.keep]:
                del self.ids[k]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.ids))
        os.replace(tmp, self.path)
