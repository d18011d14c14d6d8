"""Running the gateway: reloads, worker processes, shutdown, replica sync and the admin routes."""
