from shapewise.cli import main

raise SystemExit(main())
