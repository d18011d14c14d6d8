"""What the gateway reports about itself: Prometheus metrics, the access log and the event loop's health."""
