"""`python -m yb_decode`: run a decode engine instance."""

from yb_decode.service import DecodeService
from yb_shared.service import run_service

if __name__ == "__main__":
    raise SystemExit(run_service("decode", DecodeService))
