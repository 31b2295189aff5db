"""The heavy libraries of the speed_matrix task path, imported once by the process that forks
the task processes, so that a task finds them already loaded.

Why: on Linux every Airflow task process is a bare fork of its supervisor, and the supervisor
runs in a long-lived process: a LocalExecutor worker (itself started by the scheduler's
multiprocessing) or a Celery pool process (forked from the Celery worker). Whatever those
processes imported, every task has for free. Measured on the 2-core benchmark VM, a task of
the run that imports these on its own pays each time: Great Expectations 3.9-5.5 s
(`validate`), scipy.stats ~1.7 s and matplotlib ~0.9 s (`report`), pandas 0.6-1.3 s (most
tasks after the stop); all of it while the run's result waits, most of it after the host's
server has stopped, where it counts as host idle time. Airflow does the same for its own
modules in a Celery worker (`on_celery_import_modules`: "0.3-0.5 s per task"), but not the
module every task process parses its DAG file with (Airflow's DagBag: 0.17-0.20 s per task,
measured in a process forked after the rest of this preload), which comes first here.

How a deployment uses it (deploy/airflow.env.example):
- LocalExecutor: ``[scheduler] mp_start_method = forkserver`` and ``[scheduler]
  mp_forkserver_preload = airflow,airflow.executors.local_executor,speedmatrix.flows.preload``
  (Airflow 3.3's own settings): the executor's workers are forked from a forkserver that
  imported this module.
- CeleryExecutor: ``[celery] celery_config_options =
  speedmatrix.flows.worker_config.CELERY_CONFIG`` (Airflow's Celery settings plus Celery's
  ``imports`` naming this module): the Celery worker imports it before it forks its pool.

Only third-party libraries, never speedmatrix's own modules: those change with a deployment
of the plugins folder, and a module kept loaded by a long-lived process would run the old code
until that process restarts. The libraries change only with a new virtualenv, which restarts
the workers anyway. Nothing here opens a file, a socket or a thread, so forking after it is as
safe as forking before it (checked: one thread after these imports).

The objects are frozen out of the garbage collector's sight (`gc.freeze`, as Airflow does in its
Celery worker): otherwise every task process would walk them in each full collection, and a
collection that touches them copies the shared pages into the task's own memory.
"""

from __future__ import annotations

import gc

import airflow.dag_processing.bundles.local  # the dags-folder bundle
import airflow.dag_processing.dagbag  # noqa: F401  every task parses its DAG file with it
import duckdb  # noqa: F401  the warehouse's queries (store)
import great_expectations  # validate (quality)
import great_expectations.expectations  # noqa: F401
import matplotlib
import matplotlib.pyplot  # report, site (report.charts)
import pandas  # noqa: F401  validate, land, report, regressions, site
import pyarrow.parquet  # noqa: F401  land, and every table read (store)
import scipy.stats  # noqa: F401  report's comparison (analysis.noise's bootstrap)

matplotlib.use("Agg")  # what report.charts draws with; no figure exists yet, so it is free
gc.freeze()
