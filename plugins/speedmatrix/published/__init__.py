"""The published "Speed test matrix" page as a format: its labels and number formats
(formats.py) and the parser that reads a page back into records (parse.py, which puts together
pagetext.py, runfields.py, measurements.py, implied.py and crosscheck.py).

Why its own package, at the bottom with the other contracts: the report renders this format,
ingest and the simulator's calibration read it, and neither of the two readers may depend on
the report layer above them (the layer contract, docs/design.md "Layout").
"""
