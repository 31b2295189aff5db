"""Airflow task bodies: the only code that knows XCom shapes (docs/layout.md maps the modules)."""
