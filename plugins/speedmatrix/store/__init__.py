"""The Parquet warehouse: table schemas, landing and recovery, extra tables, the DuckDB query layer."""
