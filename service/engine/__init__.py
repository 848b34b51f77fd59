"""The inference engine: ONNX Runtime session, batch, sampling and the scheduler loop.

Nothing here knows about HTTP; routes reach the engine only through the scheduler.
"""
