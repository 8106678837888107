"""`python -m yb_prefill`: run a prefill engine instance."""

from yb_prefill.service import PrefillService
from yb_shared.service import run_service

if __name__ == "__main__":
    raise SystemExit(run_service("prefill", PrefillService))
