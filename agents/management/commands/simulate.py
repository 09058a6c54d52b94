"""manage.py simulate: a fleet of real agent processes in fixture mode, against a running control plane."""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from agents.credentials import create_join_token
from llmgw_sim.simulate import Fleet, shipped_profiles


def _interrupt(signum, frame):
    raise KeyboardInterrupt


class Command(BaseCommand):
    help = (
        "Start N real llmgw agents (python -m llmgw_agent --root <profile copy>) from the shipped node "
        "profiles, with distinct node ids and NVLink domains, against a running control plane. Ctrl-C stops them."
    )

    def add_arguments(self, parser):
        parser.add_argument("--nodes", type=int, default=6)
        parser.add_argument("--control-plane", default=os.environ.get("LLMGW_URL", "http://127.0.0.1:8000"))
        parser.add_argument(
            "--join-token",
            default=os.environ.get("LLMGW_JOIN_TOKEN", ""),
            help="or LLMGW_JOIN_TOKEN; without one, a token is created in this control plane's database",
        )
        parser.add_argument("--profiles", default="", help=f"comma-separated, of: {', '.join(shipped_profiles())}")
        parser.add_argument("--domain-size", type=int, default=2, help="simulated nodes per NVLink domain")
        parser.add_argument("--heartbeat-interval", type=float, default=5.0)
        parser.add_argument("--workdir", default=str(Path(settings.VAR_DIR) / "simulate"))
        parser.add_argument(
            "--wakeup",
            default="",
            help="where the agents' long-poll is served; by default, where the control plane's answers say",
        )

    def handle(self, *args, nodes, control_plane, join_token, profiles, domain_size, heartbeat_interval, workdir, **kw):
        wakeup = kw.get("wakeup", "")
        if nodes < 1:
            raise CommandError("--nodes must be at least 1")
        if not join_token:
            join_token = self._new_join_token(nodes)
        names = [p.strip() for p in profiles.split(",") if p.strip()] or None
        unknown = sorted(set(names or []) - set(shipped_profiles()))
        if unknown:
            raise CommandError(f"--profiles: unknown {', '.join(unknown)} (known: {', '.join(shipped_profiles())})")
        try:
            fleet = Fleet(
                nodes=nodes,
                control_plane=control_plane,
                join_token=join_token,
                workdir=Path(workdir),
                profiles=names,
                domain_size=domain_size,
                heartbeat_interval=heartbeat_interval,
                wakeup_url=wakeup,
            )
        except ValueError as e:
            raise CommandError(str(e)) from e
        # The agents run in sessions of their own (a Ctrl-C meant for this
        # command must not reach them first), so every way of stopping this
        # command becomes the same orderly stop, or the agents would outlive
        # it. SIGINT too: a command started in the background by a shell
        # inherits SIGINT ignored, and Ctrl-C would then do nothing.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _interrupt)
        fleet.start()
        for n in fleet.nodes:
            domain = f", NVLink domain {n.domain}" if n.domain else ""
            self.stdout.write(f"{n.node_id}: profile {n.profile}{domain}; log {n.dir / 'agent.log'}")
        self.stdout.write(f"{nodes} agents reporting to {control_plane}; Ctrl-C stops them")
        try:
            while fleet.alive():
                time.sleep(1)
            self.stderr.write("every agent has exited; see their logs")
        except KeyboardInterrupt:
            self.stdout.write("stopping the simulated agents")
        finally:
            fleet.stop()

    def _new_join_token(self, nodes: int) -> str:
        """A join token in this control plane's own database, for `make demo` against `make run`."""
        now = timezone.now()
        token, secret = create_join_token(
            name=f"simulate-{now:%Y%m%d-%H%M%S}", expires_at=now + dt.timedelta(days=1), max_uses=nodes, now=now
        )
        self.stdout.write(f"created join token {token.prefix}... for {nodes} simulated nodes (expires in a day)")
        return secret
