from speedmatrix.cli import main

raise SystemExit(main())
