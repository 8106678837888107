"""`python -m yb_prefill`: run a prefill engine instance."""

from yb_core.service import run_service
from yb_prefill.service import PrefillService

if __name__ == "__main__":
    raise SystemExit(run_service("prefill", PrefillService))
