"""The FastAPI layer: the app factory, its routes, schemas, errors, middleware and admission."""
