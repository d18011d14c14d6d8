"""Per-backend statistics: rolling counts, latency sketches and the model, their merge and their sharing."""
