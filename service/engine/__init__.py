"""The inference engine: ``Engine`` (engine.py) over one ``ModelRunner`` (runner.py: model.onnx
or engine.onnx, each over the ``KVPool`` that owns every row's keys and values), the step
(step.py: planned, run by the runner in one call, applied), the batch, sampling and the
scheduler loop.

Nothing here knows about HTTP; routes reach the engine only through ``Engine.submit``.
"""
