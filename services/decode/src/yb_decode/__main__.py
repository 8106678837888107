"""`python -m yb_decode`: run a decode engine instance."""

from yb_core.service import run_service
from yb_decode.service import DecodeService

if __name__ == "__main__":
    raise SystemExit(run_service("decode", DecodeService))
