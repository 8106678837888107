"""`python -m yb_gateway [--config FILE] [--instance-id ID]`."""

from __future__ import annotations

import os
import sys

#: Libraries the gateway never computes with, which its image does not install.
ABSENT_LIBRARIES = ("torch",)


def hide_absent_libraries() -> None:
    """Make the libraries of `ABSENT_LIBRARIES` unimportable in this process.

    Where one of them is installed anyway (a development checkout runs every service
    from one environment), a dependency that uses it when it finds it would load it:
    transformers imports torch to load a tokenizer, 300 MB of resident memory for
    nothing. Marked absent, every library sees what the gateway's image has, and the
    gateway runs the same here as there. transformers' notice that PyTorch is missing
    is then expected, so it is not printed.
    """
    for name in ABSENT_LIBRARIES:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def main() -> int:
    """Run the gateway until SIGINT/SIGTERM."""
    hide_absent_libraries()
    from yb_core.service import run_service
    from yb_gateway.service import GatewayService

    return run_service("gateway", GatewayService)


if __name__ == "__main__":
    sys.exit(main())
