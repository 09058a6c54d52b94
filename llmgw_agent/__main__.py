"""llmgw-agent: the node agent's command line (also `python -m llmgw_agent`).

llmgw-agent --config /etc/llmgw/agent.yaml
llmgw-agent --config agent.yaml --root profiles/hgx-h100 --once   # fixture mode, one heartbeat
llmgw-agent --config agent.yaml --check                          # validate agent.yaml and exit
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from pathlib import Path

from llmgw_agent import config as config_mod
from llmgw_agent.loop import Agent, DiscoveryProbe, Refused, Unreachable


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="llmgw-agent", description="The llmgw node agent.")
    ap.add_argument("--config", default=config_mod.DEFAULT_CONFIG, help="agent.yaml (default %(default)s)")
    ap.add_argument("--root", help="fixture mode: read sysfs, /proc and recorded tool outputs from DIR", metavar="DIR")
    ap.add_argument("--once", action="store_true", help="register, send one heartbeat, and exit (0 on success)")
    ap.add_argument("--check", action="store_true", help="load and check agent.yaml, print it, and exit")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the agent; exits only on a bad agent.yaml, --once, --check, or SIGTERM/SIGINT."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # httpx logs every request at INFO: a health check a second would drown the agent's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    try:
        cfg = config_mod.load(args.config)
        if args.root:
            cfg = dataclasses.replace(cfg, root=str(Path(args.root).resolve()))
        if args.check:
            cfg.token()  # a join_token_file that cannot be read is an error now, not at the first join
    except config_mod.ConfigError as e:
        print(f"llmgw-agent: {e}", file=sys.stderr)
        return 2
    if args.check:
        shown = dataclasses.asdict(cfg)
        shown["join_token"] = "(set)" if cfg.join_token else ""
        shown["metrics_token"] = "(set)" if cfg.metrics_token else ""
        for k, v in shown.items():
            print(f"{k}: {v}")
        return 0

    probe = DiscoveryProbe(root=cfg.root or None, model_dirs=list(cfg.model_dirs), engines_live=cfg.engines_live)
    agent = Agent(cfg, probe=probe)

    def stop(signum, frame):
        logging.getLogger("llmgw.agent").info("%s: stopping; shards keep running", signal.Signals(signum).name)
        agent.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        if args.once:
            try:
                agent.step()
            except (Unreachable, Refused) as e:
                logging.getLogger("llmgw.agent").error("%s", e)
                return 1
            return 0
        agent.run()
        return 0
    finally:
        agent.close()


if __name__ == "__main__":
    sys.exit(main())
