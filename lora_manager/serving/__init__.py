"""Serving the engine to other processes: the engine interface and the /generate wire format (protocol), the Ray
Serve application (ray_app), its adapter-affinity routing (routing), the OpenAI Images API formats (openai_api), its
Prometheus metrics (metrics), a client that looks like the engine (remote) and one seed with many adapters as a
mixed batch against one by one (compare)."""
