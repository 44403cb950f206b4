"""The operations tooling: the command line, status and explain, the demo and the
embedded redis-server. It builds on the other two layers."""
