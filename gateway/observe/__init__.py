"""What the gateway reports about itself: Prometheus metrics and the event loop's health."""
