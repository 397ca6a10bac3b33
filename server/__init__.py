"""v4serve: the OpenAI-compatible HTTP server over the runtime (app.py), its request bodies (protocol.py) and its
command line (cli.py)."""
