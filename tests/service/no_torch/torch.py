"""Put first on PYTHONPATH of a test server: any `import torch` then fails as if absent."""

raise ModuleNotFoundError("No module named 'torch' (hidden by the service tests)", name="torch")
