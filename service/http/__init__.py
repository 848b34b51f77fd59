"""The FastAPI layer: the app factory, its routes, schemas, errors, middleware, admission,
the runtime its routes reach (engine, validator, gates) and the Prometheus metrics."""
