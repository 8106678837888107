"""`python -m yb_kvstore`: run a kvstore instance."""

from yb_kvstore.service import KVStoreService
from yb_shared.service import run_service

if __name__ == "__main__":
    raise SystemExit(run_service("kvstore", KVStoreService))
