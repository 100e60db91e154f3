from vivant.cli import main

raise SystemExit(main())
