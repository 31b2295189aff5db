"""Render (Markdown, HTML) and parse (ingest) Speed test matrix reports."""
