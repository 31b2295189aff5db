"""`python -m speedmatrix.loadgen prefill|decode …` (also the zipapp's entry point)."""

from speedmatrix.loadgen.cli import main

raise SystemExit(main())
