"""The Celery workers' configuration: Airflow's, plus the task path's libraries loaded once per
worker before it forks its pool (speedmatrix.flows.preload explains why).

A deployment names it in ``[celery] celery_config_options``
(``AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS=speedmatrix.flows.worker_config.CELERY_CONFIG``).
Airflow then uses this dict as the whole Celery configuration, so it starts from Airflow's own
(``DEFAULT_CELERY_CONFIG``, built from the same ``[celery]`` settings) and adds Celery's
``imports``: the modules a worker imports at start-up, in its main process, before the pool's
processes are forked. The scheduler and the api-server read this dict too (to send tasks) but
never import what ``imports`` names: only a worker does.
"""

from __future__ import annotations

from typing import Any

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

CELERY_CONFIG: dict[str, Any] = {
    **DEFAULT_CELERY_CONFIG,
    "imports": [*DEFAULT_CELERY_CONFIG.get("imports", ()), "speedmatrix.flows.preload"],
}
