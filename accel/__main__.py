from accel.cli.main import main

raise SystemExit(main())
