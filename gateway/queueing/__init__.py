"""The gateway's queue in front of saturated backends: seats, the order requests wait in, and the waiting itself."""
