"""`python -m yb_tools.cli`: the `yb` command without the console script."""

from yb_tools.cli import main

raise SystemExit(main())
