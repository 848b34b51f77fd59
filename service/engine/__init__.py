"""The inference engine: ``Engine`` (engine.py) over one ``ModelRunner`` (runner.py: model.onnx
or engine.onnx, each over the ``KVPool`` that owns every row's keys and values), the batch,
sampling and the scheduler loop.

Nothing here knows about HTTP; routes reach the engine only through the scheduler.
"""
