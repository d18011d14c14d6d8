"""The state the gateway keeps for clients: stored responses, conversations, and where engine-kept responses live."""
