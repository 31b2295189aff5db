"""speedmatrix: speed test matrices for vLLM servers."""

__version__ = "0.1.0"

# Every log record of this package passes through the one redaction rule (speedmatrix.redact):
# installed on import, so the command line, Airflow's task logs and tests alike get it.
from speedmatrix.redact import install_log_redaction as _install_log_redaction

_install_log_redaction()
