"""speedmatrix: speed test matrices for vLLM servers."""

import logging as _logging

__version__ = "0.1.0"


def _install_log_redaction() -> None:
    """Every log record of a ``speedmatrix.*`` logger passes through the one redaction rule
    (speedmatrix.redact.redact_record) when it is made: installed on the package's import, so
    the command line, Airflow's task logs and tests alike get it. The rule's module is imported
    by the first record of ours, not here: a process that imports the package and logs nothing
    of ours (the workers' preload, which must hold no code of ours a deploy would change)
    loads none of it. Idempotent; other libraries' records are left as they are."""
    current = _logging.getLogRecordFactory()
    if getattr(current, "redacts", False):
        return

    def factory(*args, **kwargs):  # type: ignore[no-untyped-def]
        record = current(*args, **kwargs)
        name = record.name or ""  # None in logging.makeLogRecord's blank record
        if name == "speedmatrix" or name.startswith("speedmatrix."):
            from speedmatrix.redact import redact_record

            redact_record(record)
        return record

    factory.redacts = True  # type: ignore[attr-defined]
    _logging.setLogRecordFactory(factory)


_install_log_redaction()
