"""`offload-engine serve`: an OpenAI-compatible HTTP server over one Engine (app.py routes, protocol.py request
and error shapes, queue.py the one-sequence-at-a-time worker, metrics.py Prometheus text)."""
