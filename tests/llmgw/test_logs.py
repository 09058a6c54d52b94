"""The project's logging config: INFO says what happened; routine traffic is DEBUG (llmgw/logs.py)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from gateway.dataplane.app import DataPlane
from llmgw_sim import echo
from tests.gateway.conftest import make_deployment, url_of


def lines(caplog) -> list[tuple[str, str, str]]:
    return [(r.name, r.levelname, r.getMessage()) for r in caplog.records]


@pytest.mark.parametrize("name", ["celery.beat", "celery.worker.strategy", "celery.app.trace", "httpx"])
def test_a_routine_librarys_info_is_debug_and_its_warnings_stay(name, caplog):
    log = logging.getLogger(name)
    # The logger's own level too: another test may have left it higher (the agent quiets httpx).
    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger=name):
        log.info("Scheduler: Sending due task placement-reconcile")
        log.warning("something the operator must see")
    assert lines(caplog) == [(name, "WARNING", "something the operator must see")]
    caplog.clear()
    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger=name):
        log.info("Scheduler: Sending due task placement-reconcile")
    assert lines(caplog) == [(name, "DEBUG", "Scheduler: Sending due task placement-reconcile")]


def test_without_the_access_log_the_development_servers_request_lines_are_debug(settings, caplog):
    # The suite runs without LLMGW_ACCESS_LOG: runserver's request lines are routine, its 4xx warnings are not.
    assert settings.LLMGW_ACCESS_LOG is False
    log = logging.getLogger("django.server")
    with caplog.at_level(logging.INFO):
        log.info('"POST /api/v1/agent/lease HTTP/1.1" 200 133')
        log.warning('"POST /api/v1/agent/lease HTTP/1.1" 401 58')
    assert lines(caplog) == [("django.server", "WARNING", '"POST /api/v1/agent/lease HTTP/1.1" 401 58')]


def test_a_project_loggers_info_is_untouched(caplog):
    with caplog.at_level(logging.INFO):
        logging.getLogger("inventory.nodes").info("node gpu-a: registered: node joined (by agent)")
    assert lines(caplog) == [("inventory.nodes", "INFO", "node gpu-a: registered: node joined (by agent)")]


@pytest.mark.django_db(transaction=True)
def test_the_gateways_scrape_of_an_engine_is_logged_at_debug_only(caplog):
    engine = echo.serve(host="127.0.0.1", port=0, model="demo", load_seconds=0.0)
    try:
        (replica,) = make_deployment("demo", [url_of(engine)])

        async def scrape() -> DataPlane:
            plane = DataPlane()
            plane.client = httpx.AsyncClient()
            try:
                await plane.reload("all")
                await plane.scrape_once()
            finally:
                await plane.client.aclose()
            return plane

        with caplog.at_level(logging.INFO):
            plane = asyncio.run(scrape())
        # It read the engine's figures, and said nothing of it.
        assert str(replica.id) in plane.engine
        assert lines(caplog) == []
        with caplog.at_level(logging.DEBUG):
            asyncio.run(scrape())
        scraped = [r for r in caplog.records if r.name == "httpx" and "/metrics" in r.getMessage()]
        assert [(r.levelname, r.getMessage()) for r in scraped] == [
            ("DEBUG", f'HTTP Request: GET {url_of(engine)}/metrics "HTTP/1.1 200 OK"')
        ]
    finally:
        engine.shutdown()
        engine.server_close()
