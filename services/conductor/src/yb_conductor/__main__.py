"""`python -m yb_conductor`: run the conductor service."""

from yb_conductor.service import ConductorService
from yb_core.service import run_service

if __name__ == "__main__":
    raise SystemExit(run_service("conductor", ConductorService))
