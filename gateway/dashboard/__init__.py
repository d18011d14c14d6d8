"""Live per-backend latency dashboard: admin-only page, signed session cookie and JSON feed."""

from gateway.dashboard.history import FeedHistory
from gateway.dashboard.routes import COOKIE_NAME, session_principal, setup_dashboard

__all__ = ["COOKIE_NAME", "FeedHistory", "setup_dashboard", "session_principal"]
