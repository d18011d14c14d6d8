"""Per-key rate limits and token quotas: token buckets and per-period counters, kept in this process or shared through Redis."""
