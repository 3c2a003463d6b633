from copus.cli import main

raise SystemExit(main())
