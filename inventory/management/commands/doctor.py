"""`manage.py doctor`: run the doctor's checks; exit 1 when one fails."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from inventory import doctor

_MARK = {doctor.Result.PASS: "ok  ", doctor.Result.WARN: "WARN", doctor.Result.FAIL: "FAIL"}


class Command(BaseCommand):
    """Run every doctor check and print what is wrong and what to do."""

    help = "Check the cluster for trouble (nodes, clocks, NVLink, InfiniBand, GPUs, engines, replicas)."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="print the report as JSON, for scripts")

    def handle(self, *args, **options):
        now = timezone.now()
        results = doctor.run(now=now)
        if options["json"]:
            self.stdout.write(json.dumps(doctor.report(results, now=now), indent=2))
        else:
            for r in results:
                self.stdout.write(f"{_MARK[r.result]} {r.name}: {r.summary}")
                for d in r.details:
                    self.stdout.write(f"       {d}")
                if r.result != doctor.Result.PASS and r.action:
                    self.stdout.write(f"       -> {r.action}")
        if doctor.overall(results) == doctor.Result.FAIL:
            failed = ", ".join(r.name for r in results if r.result == doctor.Result.FAIL)
            raise CommandError(f"failed: {failed}", returncode=1)
