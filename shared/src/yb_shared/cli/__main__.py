"""`python -m yb_shared.cli`: the `yb` command without the console script."""

from yb_shared.cli import main

raise SystemExit(main())
