"""Serving the engine to other processes: the engine interface and the /generate wire format (protocol), the Ray
Serve application (ray_app), its adapter-affinity routing (routing), the OpenAI Images API formats (openai_api), its
Prometheus metrics (metrics) and a client that looks like the engine (remote)."""
