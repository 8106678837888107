"""`python -m yb_kvstore`: run a kvstore instance."""

from yb_core.service import run_service
from yb_kvstore.service import KVStoreService

if __name__ == "__main__":
    raise SystemExit(run_service("kvstore", KVStoreService))
