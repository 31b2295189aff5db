"""Airflow task bodies: the only code that knows XCom shapes (matrix, bisect, triggers, notifications)."""
