"""Per-key rate limits: token buckets, kept in this process or shared through Redis."""
