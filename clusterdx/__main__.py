from clusterdx.cli import main

raise SystemExit(main())
