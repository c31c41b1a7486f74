from specpilot_build.cli.main import main

raise SystemExit(main())
