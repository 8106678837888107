"""`python -m yb_gateway [--config FILE] [--instance-id ID]`."""

from __future__ import annotations

import sys

from yb_core.service import run_service
from yb_gateway.service import GatewayService


def main() -> int:
    """Run the gateway until SIGINT/SIGTERM."""
    return run_service("gateway", GatewayService)


if __name__ == "__main__":
    sys.exit(main())
