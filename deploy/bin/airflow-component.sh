#!/usr/bin/env bash
# Start ONE component of a speedmatrix Airflow deployment in the foreground.
#
# The same script runs every component, whether as a plain process (systemd, supervisord, the
# test harness in tests/deployment/) or as a container's command (deploy/docker-compose.yaml),
# so the tested start-up and the documented one cannot drift apart.
#
#   airflow-component.sh migrate | api-server | scheduler | dag-processor | triggerer | worker [ARGS…]
#
# Configuration comes from env files (KEY=value lines, Airflow's AIRFLOW__SECTION__KEY form):
# SPEEDMATRIX_AIRFLOW_ENV is a ':'-separated list, later files win (default: deploy/airflow.env).
# A second file per worker machine carries what differs there (worker name, log-server port).
# ARGS are passed on to the airflow command (e.g. `worker --celery-hostname gpu-a@%h -q default`).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
env_files="${SPEEDMATRIX_AIRFLOW_ENV:-$here/../airflow.env}"
IFS=: read -r -a files <<<"$env_files"
for f in "${files[@]}"; do
    [ -z "$f" ] && continue
    [ -r "$f" ] || { echo "airflow-component: env file not readable: $f" >&2; exit 2; }
    set -a
    # shellcheck disable=SC1090
    . "$f"
    set +a
done

: "${AIRFLOW_HOME:?set AIRFLOW_HOME in the env file}"
mkdir -p "$AIRFLOW_HOME"
airflow="${AIRFLOW_BIN:-airflow}"

component="${1:-}"
[ $# -gt 0 ] && shift
case "$component" in
    migrate) exec "$airflow" db migrate "$@" ;;
    api-server) exec "$airflow" api-server "$@" ;;
    scheduler) exec "$airflow" scheduler "$@" ;;
    dag-processor) exec "$airflow" dag-processor "$@" ;;
    triggerer) exec "$airflow" triggerer "$@" ;;
    worker) exec "$airflow" celery worker "$@" ;;
    *)
        echo "usage: airflow-component.sh migrate|api-server|scheduler|dag-processor|triggerer|worker [ARGS…]" >&2
        exit 2
        ;;
esac
