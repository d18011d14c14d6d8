"""The engines behind the gateway: live backend state, health, and what each one supports."""
