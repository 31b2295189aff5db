"""The warehouse: Delta Lake tables (schemas, landing, extra tables), the DuckDB query layer, export, maintenance and the migration from the older layout."""
