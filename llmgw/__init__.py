"""llmgw: the control plane for self-hosted LLM inference on GPU clusters."""

from llmgw.celery import app as celery_app

__all__ = ["celery_app"]
