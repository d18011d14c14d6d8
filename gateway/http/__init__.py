"""The client-facing HTTP/1.1 server on llhttp: connections, exchanges, header grammars; handed its handler, it knows no routing."""
