"""API keys: principals, authentication, and the run-time key store with where it keeps keys."""
