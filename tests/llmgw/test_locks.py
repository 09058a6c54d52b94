"""Cluster-wide locks: exclusive, and dropped with their holder (a session, or a process)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from celery import Celery

from llmgw import beat, locks

pytestmark = pytest.mark.django_db


def test_advisory_locks_are_exclusive_and_released():
    with locks.single_flight("x") as first:
        assert first
        holder = locks.HeldLock("x")
        assert not holder.held()
    assert holder.held()
    with locks.single_flight("x") as again:
        assert not again
    holder.close()
    with locks.single_flight("x") as free:
        assert free


def test_a_standby_beat_sends_nothing_until_the_holder_is_gone(tmp_path):
    app = Celery("t", set_as_current=False)
    app.conf.beat_schedule = {"t": {"task": "t.noop", "schedule": 1.0}}
    sent: list[str] = []

    class Recording(beat.LockedScheduler):
        def apply_async(self, entry, *args, **kwargs):
            sent.append(entry.name)

    leader = beat.HeldLock("beat")
    assert leader.held()
    standby = Recording(app=app, schedule_filename=str(tmp_path / "schedule"))
    try:
        assert standby.tick() == beat.LOCK_RETRY_S
        assert sent == [] and not standby.leading
        leader.close()
        standby.tick()
        assert standby.leading
    finally:
        standby.close()
        leader.close()


def test_the_file_lock_is_exclusive_and_dies_with_its_holder(tmp_path, settings):
    """SQLite's fallback: an flock, which the kernel drops with the process."""
    settings.VAR_DIR = tmp_path
    first, second = locks.FileLock("reconcile"), locks.FileLock("reconcile")
    assert first.acquire() and not second.acquire()
    first.release()
    assert second.acquire()
    second.release()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
            str(tmp_path / "locks" / "reconcile.lock"),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        assert not first.acquire()
    finally:
        holder.kill()
        holder.wait()
    assert first.acquire()
    first.release()
